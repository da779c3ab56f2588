"""Reading a config's YAML (a file, or the value of a `--set`) with limits, so that no input can make the
reader itself exhaust the machine: at most MAX_BYTES of text, MAX_DEPTH levels of nesting, MAX_VALUES values
once aliases are expanded (a 1 KB alias bomb expands to 10^9), no value inside itself, no number of more than
MAX_DIGITS digits. Each limit is a ConfigError naming the key it was met under.
"""
import re

import yaml

from ssdsgd.schema import ConfigError, key_name

MAX_BYTES = 1 << 20        # a config file; the shipped ones are under 4 KiB
MAX_DEPTH = 20             # the schema nests 4 levels (algorithm.local.lr) and a list: 5
MAX_VALUES = 100_000       # every key, list item and value, aliases expanded; a config has a few hundred
MAX_DIGITS = 100           # a number written with more digits is a mistake (and Python refuses > 4300)
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-3` as a string (it wants a dot); learning rates are written that way. The keys down
    to the node being composed are kept, to name where a limit is met."""

    def __init__(self, stream, keys=()):
        super().__init__(stream)
        self.keys = [key_name(k) for k in keys]

    def compose_node(self, parent, index):
        # PyYAML composes recursively: without this bound a 100,000-deep [[[...]]] is a RecursionError.
        named = isinstance(parent, yaml.MappingNode) and isinstance(index, yaml.ScalarNode)
        self.keys.append(key_name(index.value) if named else None)
        try:
            if len(self.keys) > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"{_where(self.keys)}nested more than {MAX_DEPTH} levels deep "
                                  f"(line {mark.line + 1}, column {mark.column + 1})")
            return super().compose_node(parent, index)
        finally:
            self.keys.pop()


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _mapping_without_duplicates(loader, node, deep=False):
    """A YAML mapping; a key given twice is an error (PyYAML would keep the last one silently, so a
    section written twice would lose the first one's keys)."""
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"{key_name(key)}: given twice in the same section (lines {seen[key] + 1} and "
                              f"{key_node.start_mark.line + 1})")
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _where(keys):
    named = [k for k in keys if k is not None]
    return ".".join(named) + ": " if named else ""


def _count(node, keys, depth, sizes, open_nodes):
    """The number of values `node` stands for with its aliases expanded (each shared node counted once per
    use, computed once); ConfigError past a limit. Depth counts through aliases: a chain of them nests too."""
    if depth > MAX_DEPTH:
        raise ConfigError(f"{_where(keys)}nested more than {MAX_DEPTH} levels deep once its aliases are expanded")
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise ConfigError(f"{_where(keys)}holds itself (an alias inside its own anchor)")
    if isinstance(node, yaml.ScalarNode):
        if node.tag in _NUMBER_TAGS and len(node.value) > MAX_DIGITS:
            raise ConfigError(f"{_where(keys)}a number of {len(node.value)} characters (at most {MAX_DIGITS})")
        return 1
    open_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        children = [(keys, child) for child in node.value]
    else:
        children = [pair for k, v in node.value for pair in
                    ((keys, k), (keys + [key_name(k.value) if isinstance(k, yaml.ScalarNode) else None], v))]
    total = 1
    for child_keys, child in children:
        total += _count(child, child_keys, depth + 1, sizes, open_nodes)
        if total > MAX_VALUES:
            raise ConfigError(f"{_where(keys)}more than {MAX_VALUES} values once its aliases are expanded "
                              f"(aliases that repeat aliases)")
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def load_yaml(text, keys=()):
    """The Python value of YAML `text` (a file's, or a `--set` value for the key path `keys`), checked against
    the limits before anything is built from it. ConfigError past a limit, yaml.YAMLError if not YAML."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"the file is larger than {MAX_BYTES >> 20} MiB; a config is a few KiB")
    loader = _Loader(text, keys)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _count(node, [key_name(k) for k in keys], 1, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()
