"""pytest plugin (-p tests.triton_probe): print how often each fused Triton kernel ran."""


def pytest_sessionfinish(session, exitstatus):
    from onnxgen.runtime.gpu.launch import LAUNCHES

    print(f"\nTRITON-LAUNCHES {dict(LAUNCHES)}")
