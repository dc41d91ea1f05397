"""The GPU suite (make test-gpu): skipped as a whole without CUDA, and a short report at the end.

Tests add lines to the report with the `report` fixture; the report is printed after pytest's
summary and, when MINIPAR_GPU_REPORT names a file, written there too.
"""

import os

import pytest
import torch

LINES: list[str] = []


def header() -> str:
    if not torch.cuda.is_available():
        return "minipar GPU report: no GPU (torch.cuda.is_available() is False): the GPU suite was skipped"
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return (f"minipar GPU report: {torch.cuda.device_count()} x {', '.join(names)} | torch {torch.__version__} "
            f"| CUDA {torch.version.cuda} | NCCL {nccl}")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no GPU: torch.cuda.is_available() is False")
        for item in items:
            item.add_marker(skip)


@pytest.fixture
def report():
    return LINES.append


def pytest_terminal_summary(terminalreporter):
    text = "\n".join([header(), *("  " + line for line in LINES)])
    terminalreporter.write_line("")
    terminalreporter.write_line(text)
    path = os.environ.get("MINIPAR_GPU_REPORT")
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
