"""GLU, the worker's local update of SSD-SGD, as a registered MXNet optimizer.

    w_loc <- w_loc - eta_l * ( rescale_grad * g_i + wd * w_loc + c * (w_s - w_loc) )

g_i is this worker's own gradient (summed over its batch; rescale_grad = 1/(N*B) as on the servers),
w_s is a per-parameter snapshot of w_loc taken right after each refresh from the global weights
(the optimizer state; the worker calls `snapshot`), and c = 0.5 in the authors' code.

Provenance: the SSD-SGD paper's GLU equation could not be retrieved (only its abstract). This is
the rule the authors' released MXNet code intends (its `dc_sgd_update` kernel computes
-lr*(wd*w + g + 0.5*(w_s - w)) with w_s a snapshot every k local steps); the released version has
argument-order and shared-counter bugs, so we implement the evident intent with one state per
parameter. eta_l = 4 * eta_g with no local momentum in their scripts. With c = 0 this is plain
local SGD, the ablation that measures what the compensation term buys.
"""
import mxnet as mx


@mx.optimizer.Optimizer.register
class GLU(mx.optimizer.Optimizer):
    def __init__(self, c=0.5, **kwargs):
        super().__init__(**kwargs)
        self.c = float(c)

    def create_state(self, index, weight):
        return weight.copy()          # w_s, the snapshot

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        step = grad * self.rescale_grad + wd * weight + self.c * (state - weight)
        mx.nd.elemwise_sub(weight, lr * step, out=weight)

    @staticmethod
    def snapshot(state, weight):
        weight.copyto(state)
