import pytest

from shardline.services import blocks
from shardline.services.errors import ShardlineConfigError


@pytest.mark.parametrize("numel, size", [(0, 4), (1, 4), (4, 4), (5, 4), (1000, 300), (262144 * 3 + 1, 262144)])
def test_slices_partition_the_tensor(numel, size):
    slices = blocks.block_slices(numel, size)
    assert len(slices) == max(1, -(-numel // size))
    assert slices[0].start == 0 and slices[-1].stop == numel
    for prev, cur in zip(slices, slices[1:]):
        assert prev.stop == cur.start
    assert all(0 < s.numel <= size for s in slices) or numel == 0
    assert [s.index for s in slices] == list(range(len(slices)))
    assert sum(s.numel for s in slices) == numel


def test_small_tensor_is_one_block():
    assert blocks.num_blocks(10, blocks.DEFAULT_BLOCK_ELEMENTS) == 1


def test_block_slice_bounds():
    assert blocks.block_slice(10, 4, 2).numel == 2
    with pytest.raises(IndexError):
        blocks.block_slice(10, 4, 3)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, blocks.MAX_BLOCK_ELEMENTS + 1])
def test_block_size_validated(bad):
    with pytest.raises(ShardlineConfigError, match=repr(bad)):
        blocks.block_slices(10, bad)


def test_block_key_and_hash():
    import cityhash

    assert blocks.block_key("job", "layers.0.w", 3) == "job/layers.0.w/3"
    assert blocks.block_hash("job", "layers.0.w", 3) == cityhash.CityHash64("job/layers.0.w/3")


def test_runs_of_end_once_they_reach_the_limit():
    from shardline.services.blocks import runs_of

    assert runs_of([], len, 4) == []
    assert runs_of(["ab", "c", "d", "efgh", "i"], len, 4) == [["ab", "c", "d"], ["efgh"], ["i"]]
    assert runs_of(["abcdefg", "h"], len, 4) == [["abcdefg"], ["h"]]   # a larger item is a run of its own
