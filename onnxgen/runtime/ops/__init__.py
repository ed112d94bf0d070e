"""ONNX op implementations: one module per op family; each registers itself with ``registry.implements``.

They run on any torch device. Where a GPU kernel of ``onnxgen.runtime.gpu`` serves a case faster,
the implementation calls it and keeps the torch path for the rest."""
