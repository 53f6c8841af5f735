"""The streaming shard writer: plain safetensors files, identical to concatenating the samples."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvshot.capture.shard_writer import ShardWriter, plan_shards


def _samples(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        out.append({"input_ids": torch.randint(0, 100, (n,), generator=gen, dtype=torch.int32),
                    "loss_mask": torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8),
                    "aux_hidden": torch.randn(n, 3, 5, generator=gen),
                    # a transposed view, as the target's cache hands keys over
                    "key_1": torch.randn(2, n, 4, generator=gen).transpose(0, 1),
                    "half": torch.randn(n, 3, generator=gen).to(torch.bfloat16)})
    return out


def test_plan_closes_a_shard_once_it_reaches_shard_tokens():
    assert plan_shards([2, 0, 1, 3], [5, 3, 4, 6], 8) == [[2, 0], [1, 3]]
    assert plan_shards([0, 1, 2], [3, 3, 3], 100) == [[0, 1, 2]]
    assert plan_shards([], [], 8) == []


def test_shards_equal_concatenated_samples_in_any_add_order(tmp_path):
    lengths = [5, 1, 7, 3, 4, 6]
    samples = _samples(lengths)
    order = [3, 1, 0, 5, 2, 4]
    writer = ShardWriter(tmp_path, order, lengths, shard_tokens=9)
    # packed rows of a batch in planned order that straddles two shards,
    batch = [1, 0, 5]
    writer.add(batch, {k: torch.cat([samples[i][k] for i in batch]) for k in samples[0]})
    # a right-padded batch (as the target returns it) out of planned order,
    padded = {k: torch.nn.utils.rnn.pad_sequence([samples[i][k] for i in [4, 3]], batch_first=True)
              for k in samples[0]}
    padded["key_1"] = padded["key_1"].transpose(1, 2).contiguous().transpose(1, 2)   # [B, T, H, D] strided
    writer.add([4, 3], padded, padded=True)
    writer.add([2], samples[2])                       # and a single sample
    writer.close()
    assert len(writer.shards) == len(writer.plan) == 3
    expected_bytes = 0
    for s, members in enumerate(writer.plan):
        stored = load_file(str(tmp_path / writer.shards[s]))    # safetensors' own reader accepts it
        assert set(stored) == set(samples[0])
        for k, v in stored.items():
            want = torch.cat([samples[i][k] for i in members])
            assert v.dtype == want.dtype and torch.equal(v, want), k
            expected_bytes += v.numel() * v.element_size()
        with safe_open(str(tmp_path / writer.shards[s]), framework="pt") as h:
            for i in members:
                shard, start, n = writer.locations[i]
                assert shard == s
                assert torch.equal(h.get_slice("aux_hidden")[start: start + n], samples[i]["aux_hidden"])
    assert writer.bytes == expected_bytes == sum(writer.bytes_by_name.values())


def test_missing_or_malformed_samples_are_errors(tmp_path):
    lengths = [2, 3]
    samples = _samples(lengths)
    writer = ShardWriter(tmp_path, [0, 1], lengths, shard_tokens=100)
    writer.add([0], samples[0])
    with pytest.raises(ValueError, match="written twice"):
        writer.add([0], samples[0])
    bad = dict(samples[1], aux_hidden=samples[1]["aux_hidden"][:, :2])
    with pytest.raises(ValueError, match="field aux_hidden"):
        writer.add([1], bad)
    with pytest.raises(ValueError, match="field key_1"):
        writer.add([1], dict(samples[1], key_1=samples[0]["key_1"]))     # rows of another sample
    with pytest.raises(ValueError, match="have tensors"):
        writer.add([1], {k: v for k, v in samples[1].items() if k != "half"})
    with pytest.raises(RuntimeError, match="1 samples never written"):
        writer.close()


def test_an_error_inside_the_block_stands_and_releases_the_files(tmp_path):
    lengths = [2, 3]
    samples = _samples(lengths)
    with pytest.raises(KeyError):
        with ShardWriter(tmp_path, [0, 1], lengths, shard_tokens=100) as writer:
            writer.add([0], samples[0])
            raise KeyError("the caller's error")    # not masked by "samples never written"
    assert writer._open == {}
