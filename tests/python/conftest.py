"""Shared pytest setup: import path, devices to parametrize over, markers."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

# Run the tests from a checkout without installing moe8: python/ holds the package (and the built _C).
if importlib.util.find_spec("moe8") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))


def _cuda() -> bool:
    import moe8

    return torch.cuda.is_available() and moe8.cuda_available()


def devices():
    """Devices to run a test on: always the CPU; CUDA when moe8 was built with it and a GPU is visible."""
    return [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not _cuda(), reason="no CUDA build or no GPU")),
    ]


FUZZ_TABLES = pytest.StashKey[list]()  # test_fuzz's case counts per device, for the terminal summary


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its tables go to the controller's summary
        workeroutput["moe8_fuzz_tables"] = session.config.stash.get(FUZZ_TABLES, [])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    tables = getattr(node, "workeroutput", {}).get("moe8_fuzz_tables", [])
    node.config.stash.setdefault(FUZZ_TABLES, []).extend(tables)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tables = config.stash.get(FUZZ_TABLES, [])
    if tables:
        terminalreporter.section("fuzz case counts")
        for t in tables:
            terminalreporter.write_line(t)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: takes more than a few seconds on CPU (deselect with -m 'not slow')"
    )


def pytest_report_header(config):
    import moe8

    gpu = torch.cuda.get_device_name(0) if _cuda() else "none"
    return f"moe8 {moe8.__version__}, torch {torch.__version__}, CUDA device: {gpu}"
