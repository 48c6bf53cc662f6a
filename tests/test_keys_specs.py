import numpy as np
import pytest

import tiering
import tiering.backends as backends
from tiering import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)


def test_key_packs_hash_and_big_endian_group():
    key = make_offload_key(b"\xab" * 16, 258)
    assert key == b"\xab" * 16 + b"\x00\x00\x01\x02"
    assert get_offload_block_hash(key) == b"\xab" * 16
    assert get_offload_group_idx(key) == 258
    with pytest.raises(OverflowError):
        make_offload_key(b"h", 2**32)


def test_specs_store_int64_block_ids_and_name_their_medium():
    spec = CPULoadStoreSpec([3, 1, 2])
    assert spec.block_ids.dtype == np.int64 and spec.block_ids.tolist() == [3, 1, 2]
    assert CPULoadStoreSpec.medium() == "CPU" and GPULoadStoreSpec.medium() == "GPU"
    assert isinstance(spec, BlockIDsLoadStoreSpec)
    assert repr(spec) == "CPULoadStoreSpec([3, 1, 2])"


def test_gpu_spec_groups():
    spec = GPULoadStoreSpec([5, 6, 7, 9], group_sizes=[3, 1], block_indices=[2, 0])
    assert (list(spec.group_sizes), list(spec.block_indices)) == ([3, 1], [2, 0])
    with pytest.raises(ValueError, match="group_sizes sum to 3 but there are 4 block ids"):
        GPULoadStoreSpec([5, 6, 7, 9], group_sizes=[2, 1], block_indices=[0, 0])
    with pytest.raises(ValueError, match="1 block_indices for 2 KV groups"):
        GPULoadStoreSpec([5, 6], group_sizes=[1, 1], block_indices=[0])


@pytest.mark.parametrize("package", [tiering, backends])
def test_public_names_are_exported(package):
    assert sorted(package.__all__) == package.__all__
    for name in package.__all__:
        assert getattr(package, name) is not None
