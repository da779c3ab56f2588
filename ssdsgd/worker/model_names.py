"""The names model.name may take: ours (the small models of ssdsgd/worker/models.py) and the gluoncv
model zoo's. Apart from models.py, which imports MXNet, so that the launcher front end checks a name
without it."""

SMALL_MODELS = ("linear", "mlp", "small_cnn")


class ModelError(ValueError):
    pass


def check_model_name(name):
    if name in SMALL_MODELS:
        return
    from gluoncv.model_zoo import get_model_list   # only for a zoo name: gluoncv imports MXNet (seconds)
    if name not in get_model_list():
        raise ModelError(f"model.name: unknown model {name!r}; use one of {', '.join(SMALL_MODELS)} "
                         f"or a gluoncv model zoo name such as cifar_resnet20_v1, cifar_resnet56_v1, "
                         f"resnet50_v1")
