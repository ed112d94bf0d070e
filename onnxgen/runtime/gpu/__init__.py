"""GPU kernels written in Triton, with their launch tables and launch support (``launch``).

Each module imports Triton at import time, so only code that has checked
``launch.triton_serves`` imports them, on use. The ONNX op implementations in
``onnxgen.runtime.ops`` and the runtime's ``device_kernels`` call them; nothing above the runtime
does."""
