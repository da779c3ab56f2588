"""ssdsgd: SSD-SGD parameter-server training on Apache MXNet.

Importing this package must not import mxnet: server and scheduler roles have to adjust
DMLC_ROLE before mxnet is imported (see ssdsgd.train).
"""
__version__ = "0.1.0"
