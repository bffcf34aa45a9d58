"""Fixtures of the two-rank tests; the launch helpers are in torchrun_launch.py."""
import pytest
from torchrun_launch import cli


@pytest.fixture
def run_cli():
    return cli
