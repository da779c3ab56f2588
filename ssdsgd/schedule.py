"""Learning-rate schedules, indexed by the 1-based count of global updates (MXNet's num_update).

The same class serves the stock MXNet optimizer on the servers (it is pickled there with the
optimizer, so it must live in an importable module and keep a `base_lr` attribute that
mx.optimizer.Optimizer sets) and our own round-based server, which builds it from plain data.
"""
import math

KINDS = ("constant", "step", "cosine", "poly")


class LRSchedule:
    def __init__(self, kind="constant", base_lr=0.1, total_updates=1, warmup_updates=0,
                 milestones=(), factor=0.1, power=2.0, final_lr=0.0):
        if kind not in KINDS:
            raise ValueError(f"unknown lr schedule {kind!r}")
        self.kind = kind
        self.base_lr = float(base_lr)
        self.total_updates = max(1, int(total_updates))
        self.warmup_updates = int(warmup_updates)
        self.milestones = sorted(int(m) for m in milestones)
        self.factor = float(factor)
        self.power = float(power)
        self.final_lr = float(final_lr)

    def to_dict(self):
        """Plain data (JSON): how a schedule travels to the servers; from_dict reads it back."""
        return dict(kind=self.kind, base_lr=self.base_lr, total_updates=self.total_updates,
                    warmup_updates=self.warmup_updates, milestones=list(self.milestones),
                    factor=self.factor, power=self.power, final_lr=self.final_lr)

    def scaled(self, scale):
        """The same shape with base and final lr multiplied (the local lr follows the global one)."""
        d = self.to_dict()
        d["base_lr"] *= scale
        d["final_lr"] *= scale
        return LRSchedule.from_dict(d)

    @classmethod
    def from_dict(cls, d):
        return cls(**d)

    def __call__(self, num_update):
        t = num_update
        if self.warmup_updates > 0 and t < self.warmup_updates:
            return self.base_lr * t / self.warmup_updates          # linear ramp from 0
        if self.kind == "constant":
            return self.base_lr
        if self.kind == "step":
            passed = sum(1 for m in self.milestones if t > m)
            return self.base_lr * self.factor ** passed
        span = max(1, self.total_updates - self.warmup_updates)
        frac = min(1.0, max(0.0, (t - self.warmup_updates) / span))
        if self.kind == "cosine":
            return self.final_lr + (self.base_lr - self.final_lr) * (1 + math.cos(math.pi * frac)) / 2
        return self.final_lr + (self.base_lr - self.final_lr) * (1 - frac) ** self.power


def held_carry(schedule, rnd):
    """The factor that carries a value held back in gradient units (error feedback, momentum correction)
    from the rate round rnd - 1 is applied at to round rnd's, so that the servers apply it as SSGD
    would have at its own step (compression.rescale_held). Round r is applied at schedule(r + 1). 1 for
    round 0 and where either rate is 0 (a zero rate applies nothing: the values keep their scale)."""
    before, now = schedule(rnd), schedule(rnd + 1)
    return before / now if rnd > 0 and before > 0 and now > 0 else 1.0


def schedule_from_config(train_cfg, steps_per_epoch):
    """Build the global schedule from the `train` section; epochs are converted to updates."""
    s = train_cfg.lr_schedule
    # max_steps only cuts a run short; it does not compress the schedule.
    total = train_cfg.epochs * steps_per_epoch
    return LRSchedule(kind=s.type, base_lr=train_cfg.lr, total_updates=total,
                      warmup_updates=int(round(s.warmup_epochs * steps_per_epoch)),
                      milestones=[m * steps_per_epoch for m in s.milestones],
                      factor=s.factor, power=s.power, final_lr=s.final_lr)
