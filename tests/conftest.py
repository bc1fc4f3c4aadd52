import numpy as np
import pytest
import tvm

from hgrt.testing import elementwise_lib


@pytest.fixture(scope="session")
def lib():
    return elementwise_lib()


@pytest.fixture(scope="session")
def two_cpus():
    return [tvm.cpu(0), tvm.cpu(1)]


@pytest.fixture
def rng():
    return np.random.default_rng(0)
