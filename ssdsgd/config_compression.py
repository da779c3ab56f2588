"""The compression section's checks (its keys against each other and against algorithm.type), and the keys
whose value follows compression.density: auto's candidates and the density warm-up's default, which a run
with auto resolves once it has chosen (with_density), as a config giving that number resolves them."""
import math

from ssdsgd.compression.registry import NATIVE_2BIT, SPARSIFIERS, is_sparsifier, sparsifier_names
from ssdsgd.registry import ALGORITHMS
from ssdsgd.schema import AUTO_DENSITIES, RING_DOWNLINKS, ConfigError, shown


def check_compression_type(algorithm, kind, sparsifier):
    """compression.type against what algorithm.type's client takes (its registry entry)."""
    entry = ALGORITHMS[algorithm]
    if sparsifier and not entry.sparsifiers:
        takers = " or ".join(n for n, a in ALGORITHMS.items() if a.sparsifiers)
        raise ConfigError(f"compression.type: {kind} needs the round-based server (algorithm.type {takers}); "
                          f"{algorithm} supports {' or '.join(entry.compression)}")
    if not sparsifier and kind not in entry.compression:
        takers = " or ".join(n for n, a in ALGORITHMS.items() if kind in a.compression) or "none"
        instead = f"use {'/'.join(SPARSIFIERS)} with {algorithm}" if entry.sparsifiers else \
            f"{algorithm} supports {' or '.join(entry.compression)}"
        native = " (MXNet's native compression, on the stock KVStore path)" if kind == NATIVE_2BIT else ""
        raise ConfigError(f"compression.type: {kind}{native} works with algorithm.type {takers}; {instead}")


def check_compression(c, sparsifier):
    """The compression section's keys against each other (and train.epochs)."""
    comp = c["compression"]
    # Settings that only mean something for a sparse push: (set?, why), per key.
    sparse_only = {
        "fp16_values": (comp["fp16_values"], "only sparse pushes have an fp16 wire format"),
        "index_coding": (comp["index_coding"] != "auto", "only sparse messages carry indices"),
        "warmup": (bool(comp["warmup"]), "a density warm-up needs a sparsifier"),
        "selection": (comp["selection"] == "sampled", "only the sparse encoders select values"),
        "rescale_held": (comp["rescale_held"], "only a sparsifier's error feedback holds values back to rescale"),
        "downlink": (comp["downlink"] in RING_DOWNLINKS,
                     f"{comp['downlink']} rebuilds the global weights from the rounds' sparse updates, so it "
                     f"needs a sparsifier"),
    }
    for key, (is_set, why) in sparse_only.items():
        if is_set and not sparsifier:
            raise ConfigError(f"compression.{key}: {why}; set compression.type to {sparsifier_names()} "
                              f"(got {comp['type']})")
    if comp["allocation"] == "gradient" and (not sparsifier or comp["fusion"] != "ahead"):
        raise ConfigError("compression.allocation: gradient re-allocates the per-tensor quotas of "
                          "sparsification ahead of fusion; it needs compression.fusion: ahead and a "
                          f"sparsifier (got fusion {comp['fusion']}, type {comp['type']})")
    if not comp["momentum_masking"] and not comp["momentum_correction"]:
        raise ConfigError("compression.momentum_masking: masks the momentum of DGC's momentum correction; "
                          "false needs compression.momentum_correction: true")
    if comp["rescale_held"] and not (comp["error_feedback"] or comp["momentum_correction"]):
        raise ConfigError("compression.rescale_held: rescales what error feedback and momentum correction hold "
                          "back; with both off nothing is held (set compression.error_feedback: true)")
    if comp["density"] == "auto":
        _check_auto_density(c, sparsifier)
    elif any(d < comp["density"] for d in comp["warmup"] or ()):
        raise ConfigError(f"compression.warmup: a warm-up density below compression.density "
                          f"({comp['density']}) would not be a warm-up; got {shown(comp['warmup'])}")
    if len(comp["warmup"] or ()) >= c["train"]["epochs"]:
        raise ConfigError(f"compression.warmup: {len(comp['warmup'])} warm-up epochs but train.epochs is "
                          f"{c['train']['epochs']}; the run would never reach compression.density")


def _check_auto_density(c, sparsifier):
    """density: auto chooses among the densities below the warm-up's, if one is given. (Every algorithm that
    takes a sparsifier runs on the round-based server, whose keys the link probe uses.)"""
    comp = c["compression"]
    if sparsifier and not auto_densities(comp):
        raise ConfigError(f"compression.warmup: ends at {min(comp['warmup']):g}, below every density auto chooses "
                          f"from ({', '.join(f'{d:g}' for d in AUTO_DENSITIES)}); give the density by hand")


def auto_densities(comp):
    """The densities compression.density: auto chooses from: AUTO_DENSITIES, those at most the last of a
    given compression.warmup (a warm-up must not end below the density that follows it)."""
    warmup = comp["warmup"] if isinstance(comp, dict) else comp.warmup
    return [d for d in AUTO_DENSITIES if not warmup or d <= min(warmup)]


def density_note(cfg):
    """What --dry-run says of compression.density: auto (None when the config gives a number)."""
    comp = cfg.compression
    if comp.density != "auto" or not is_sparsifier(comp.type):
        return None
    return (f"compression.density: auto: the workers choose one of {', '.join(f'{d:g}' for d in auto_densities(comp))} "
            f"at the start of the synchronous warm-up, from the link rates and the step they measure (a resume "
            f"keeps the checkpoint's)")


def with_density(cfg, density):
    """cfg with compression.density: auto replaced by the density chosen (or a checkpoint's), and the keys
    whose default follows the density (compression.warmup) resolved as a config giving that number would
    resolve them: the run is then the run of that config, bit for bit. cfg itself if it gives a number."""
    if cfg.compression.density != "auto":
        return cfg
    data = cfg.to_dict()
    comp = data["compression"]
    comp["density"] = float(density)
    if comp["warmup"] is None:
        comp["warmup"] = density_warmup(comp["density"], data["train"])
    check_compression(data, is_sparsifier(comp["type"]))
    return cfg.replaced(data)


def density_warmup(density, train):
    """compression.warmup's default. Under a learning-rate warm-up, error feedback holds a value back for
    about 1/density steps and sends it at a later step's rate, many times the rate of the step that
    computed it (docs/design.md, "Density under a learning-rate warm-up"). A dense warm-up sends most
    values at about their own step's rate while the rate rises (DGC's ramp, held through the lr warm-up)."""
    lr_warmup = train["lr_schedule"]["warmup_epochs"]
    if not lr_warmup or density >= 0.25:
        return []
    ramp = [0.25] * math.ceil(lr_warmup)
    while ramp[-1] / 4 > density:
        ramp.append(ramp[-1] / 4)
    return ramp[:(train["epochs"] - 1) // 2]


def resumed_density(cfg, manifest):
    """cfg with compression.density: auto replaced by the density the checkpoint's run chose (the number in its
    manifest's config parts), so a resume goes on with it; cfg itself otherwise."""
    saved = manifest.get("config") if isinstance(manifest, dict) else None
    density = (saved.get("compression") or {}).get("density") if isinstance(saved, dict) else None
    if cfg.compression.density != "auto" or isinstance(density, bool) or not isinstance(density, (int, float)) \
            or not 0 < density <= 1:
        return cfg
    return with_density(cfg, density)
