"""compression.density: auto, at the start of the synchronous warm-up, before the servers get their plan
(every buffer's mailbox and downlink ring is sized for one density): each worker times its step's forward
and backward and its encoding at every candidate density, then, with every other worker at the same
moment, pushes and pulls (probe.measure_link); every worker then makes the same choice from everyone's
numbers (density_choice.choose). Under compression.buffers: cost_model, whose plan needs the link's costs
probed later, every candidate is estimated on the plan of one buffer per server: the same values and
indices in fewer messages."""
import math

from ssdsgd.algorithms.density_choice import Measured, choose, traffic
from ssdsgd.algorithms.probe import measure_link
from ssdsgd.compression.encoders import make_encoders, time_encoding
from ssdsgd.compression.fusion import tensor_counts
from ssdsgd.config import auto_densities, with_density
from ssdsgd.ps.commands import num_servers


def choose_density(cfg, kv, shapes, time_step):
    """(cfg with the density chosen, the density_choice.Choice). time_step(): seconds of one step's forward
    and backward on this worker's devices."""
    comp, servers = _estimated_section(cfg), num_servers(kv)
    densities = auto_densities(comp)
    compute = time_step()
    encode = []
    for d in densities:
        buffers, encoders = make_encoders(shapes, servers, comp, kv.rank, momentum=cfg.train.momentum,
                                          seed=cfg.seed, counts=tensor_counts(shapes, comp, d))
        encode.append(time_encoding(buffers, encoders, shapes))
    size = sum(math.prod(s) for s in shapes)
    rows = measure_link(kv, size, [compute, *encode])
    measured = [Measured(r[4], r[0], r[1], r[2], r[3], tuple(r[5:])) for r in rows]
    traffics = [traffic(shapes, comp, d, kv.num_workers, servers, cfg.algorithm) for d in densities]
    choice = choose(measured, densities, traffics, comp.auto_slack, 4 * size)
    return with_density(cfg, choice.density), choice


def _estimated_section(cfg):
    """The compression section the candidates are timed and counted with (see the module)."""
    if cfg.compression.buffers != "cost_model":
        return cfg.compression
    data = cfg.to_dict()
    data["compression"]["buffers"] = "one"
    return cfg.replaced(data).compression

