"""The names model.name may take: ours (the small models of ssdsgd/worker/models.py) and the gluoncv
model zoo's. Apart from models.py, which imports MXNet, so that the launcher front end checks a name
without it."""
import ast
import os

from ssdsgd.lean_mxnet import package_folder

SMALL_MODELS = ("linear", "mlp", "small_cnn")


class ModelError(ValueError):
    pass


def zoo_names():
    """The gluoncv model zoo's names, read from the source of gluoncv/model_zoo/model_zoo.py (its `_models`
    table, which get_model_list returns) rather than imported: importing gluoncv imports MXNet, seconds of CPU
    in the front end of every job. None if gluoncv is missing or the file has no such table (another version)."""
    folder = package_folder("gluoncv")
    if folder is None:
        return None
    path = os.path.join(folder, "model_zoo", "model_zoo.py")
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_models"]
                and isinstance(node.value, ast.Dict)):
            names = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
            return set(names) if len(names) == len(node.value.keys) else None
    return None


def check_model_name(name):
    if name in SMALL_MODELS:
        return
    names = zoo_names()
    if names is None:
        from gluoncv.model_zoo import get_model_list   # the table could not be read: gluoncv's own list
        names = set(get_model_list())
    if name not in names:
        raise ModelError(f"model.name: unknown model {name!r}; use one of {', '.join(SMALL_MODELS)} "
                         f"or a gluoncv model zoo name such as cifar_resnet20_v1, cifar_resnet56_v1, "
                         f"resnet50_v1")
