"""Evaluation shared by all workers (train.eval_workers: all): each worker counts the correct
predictions on its share of the evaluation set and pushes [correct, images] to one KVStore key;
the servers add every push into it (ssdsgd/ps/server.py), so rank 0 reads the sum.

The key only ever grows: rank 0 remembers the totals it last read and waits until the images
counted since then reach the evaluation set's size (every worker has pushed), whatever the
KVStore's mode (dist_sync merges the pushes of a round before adding them, dist_async adds each).
The counts travel as float32, exact up to 2**24 images evaluated in one job.
"""
import time

import numpy as np

TALLY_KEY = (1 << 20) + 3      # far above any plan key, next to the link probe's keys
EXACT_COUNT = 1 << 24          # float32 holds every integer below this exactly


class EvalTally:
    def __init__(self, kv):
        """Collective: every worker constructs it (kv.init ends with a barrier)."""
        import mxnet as mx   # not at import: ps/server.py imports this module before MXNet (run_server)
        self.kv = kv
        kv.init(TALLY_KEY, mx.nd.zeros(2))
        self.buf = mx.nd.zeros(2)
        self.seen = np.zeros(2)             # the sums rank 0 read at its last evaluation

    def push(self, correct, images):
        """This worker's counts for one evaluation."""
        import mxnet as mx   # not at import: ps/server.py imports this module before MXNet (run_server)
        self.kv.push(TALLY_KEY, mx.nd.array([correct, images]))

    def wait_sum(self, images, poll_seconds=0.005):
        """Rank 0: (correct, images) summed over the workers for this evaluation, once the images
        counted since the last call reach `images` (the size of the evaluation set)."""
        while True:
            self.kv.pull(TALLY_KEY, out=self.buf)
            total = self.buf.asnumpy().astype(np.float64)
            if total[1] - self.seen[1] >= images:
                break
            time.sleep(poll_seconds)
        if total[1] >= EXACT_COUNT:
            raise RuntimeError(f"train.eval_workers: all: {int(total[1])} images evaluated in this job, more than "
                               f"the float32 tally counts exactly ({EXACT_COUNT}); evaluate less often")
        got = total - self.seen
        self.seen = total
        if got[1] != images:                # a worker already counted its next evaluation
            raise RuntimeError(f"train.eval_workers: all: the workers evaluated {int(got[1])} images since the "
                               f"last evaluation, expected {images}")
        return int(got[0]), int(got[1])
