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

from ssdsgd.compression.flatviews import FlatViews


class _WholeStates:
    """state_views for the optimizers whose refresh writes each state whole (GLU's snapshot; LocalSGD
    has no state to refresh)."""

    @staticmethod
    def state_views(states):
        """What refresh_buffer writes, made once per buffer: FlatViews of the states (None: nothing)."""
        return None if any(s is None for s in states) else FlatViews(states)


@mx.optimizer.Optimizer.register
class GLU(_WholeStates, mx.optimizer.Optimizer):
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
    def refresh(state, weight, rounds=0):
        """Take the snapshot w_s of the global weights just landed (`rounds`: unused here)."""
        weight.copyto(state)

    @staticmethod
    def refresh_buffer(views, new, rounds=0):
        """refresh for every parameter of a buffer: `views` from state_views, `new` the global
        weights just landed (a flatviews.FlatBuffer cut like the buffer's parameters)."""
        views.copy_from(new)


class LocalSGD(_WholeStates, mx.optimizer.SGD):
    """Plain local SGD (no compensation): MXNet's SGD, with the refresh hooks the client calls."""

    @staticmethod
    def refresh(state, weight, rounds=0):
        pass

    @staticmethod
    def refresh_buffer(views, new, rounds=0):
        pass


@mx.optimizer.Optimizer.register
class GlobalMomentum(mx.optimizer.Optimizer):
    """Local momentum SGD whose velocity is the global model's, re-estimated at every refresh.

        at a refresh that advanced the global weights by r rounds:  v <- (w_new - w_prev) / r
        every local step:  v <- mu * v - eta_l * (rescale_grad * g_i + wd * w_loc);  w_loc <- w_loc + v

    Between refreshes the servers keep moving the global weights along their momentum; a worker
    that only applies its own gradient falls behind them, so the gradients it pushes are computed
    further and further from where they will be applied (staleness). Carrying the global velocity
    forward makes w_loc track the global trajectory instead; with eta_l = N * eta_g (lr_scale = N)
    the worker's own gradient stands in for the sum of all N that it cannot see yet. The update is
    MXNet's sgd_mom_update, so with no refreshes it is the servers' own rule.

    State per parameter: one array of shape (2,) + weight.shape holding [w_prev, v], so checkpoints
    store it like the other local optimizers' single-array state.
    """

    def __init__(self, momentum=0.9, **kwargs):
        super().__init__(**kwargs)
        self.momentum = float(momentum)

    def create_state(self, index, weight):
        state = mx.nd.zeros((2,) + weight.shape, dtype=weight.dtype)
        state[0] = weight
        return state

    def update(self, index, weight, grad, state):
        self._update_count(index)
        # One fused operator per parameter (the servers' own rule): the same arithmetic written as
        # NDArray expressions took seven times the CPU, on the worker's critical path every step.
        mx.nd.sgd_mom_update(weight, grad, state[1], out=weight, lr=self._get_lr(index),
                             wd=self._get_wd(index), momentum=self.momentum, rescale_grad=self.rescale_grad,
                             clip_gradient=self.clip_gradient if self.clip_gradient else -1.0)

    @staticmethod
    def state_views(states):
        """What refresh_buffer works on, made once per buffer: the previous global weights and the
        velocity of every state as FlatViews, and a flat scratch vector cut like them."""
        prev = FlatViews([s[0] for s in states])
        return prev, FlatViews([s[1] for s in states]), prev.buffer()

    @staticmethod
    def refresh_buffer(views, new, rounds):
        """For every parameter of a buffer: `views` from state_views, `new` the global weights just
        landed (a flatviews.FlatBuffer cut like the parameters), `rounds` rounds newer than the
        previous refresh's. The arithmetic runs once on the flat vectors."""
        prev, velocity, scratch = views
        if rounds > 0:
            prev.copy_to(scratch)
            mx.nd.elemwise_sub(new.array, scratch.array, out=scratch.array)
            if rounds != 1:
                velocity_flat = scratch.array      # (a NamedTuple field cannot take an in-place /=)
                velocity_flat /= rounds
            velocity.copy_from(scratch)
        prev.copy_from(new)

    @staticmethod
    def refresh(state, weight, rounds):
        """The rule per parameter (the client refreshes whole buffers with refresh_buffer, tested bit for
        bit against this): weight, the global weights just landed, `rounds` rounds newer than the
        previous refresh's."""
        prev, velocity = state[0], state[1]          # views into the state array
        if rounds > 0:
            mx.nd.elemwise_sub(weight, prev, out=velocity)
            if rounds != 1:
                velocity /= rounds
        weight.copyto(prev)
