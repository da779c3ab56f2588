"""Worker-side encoding of one buffer's gradients into a mailbox payload (asynchronous mx.nd ops)."""
import mxnet as mx

from ssdsgd.compression.fusion import make_plan


class DenseEncoder:
    """The buffer's gradients, flattened and concatenated: what an uncompressed push sends."""
    codec = "dense"

    def encode(self, grads, step):
        if len(grads) == 1:
            return grads[0].reshape(-1)
        return mx.nd.concat(*[g.reshape(-1) for g in grads], dim=0)


def make_encoders(shapes, num_servers, comp, rank):
    """Buffer plan plus one encoder per buffer, for the `compression` config section."""
    if comp.type != "none":
        raise NotImplementedError(f"compression.type {comp.type} is not implemented yet")
    buffers = make_plan(shapes, num_servers, mode="fixed" if comp.buffers == "fixed" else "one",
                        buffer_bytes=comp.buffer_bytes)
    return buffers, [DenseEncoder() for _ in buffers]
