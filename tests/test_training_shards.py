"""Training data from a directory of .npz shards: the same batches, losses and checkpoints as one
.npz holding the same samples, resume that continues bit-identically, bad shards as one-line errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from gradgen.errors import UsageError
from gradgen.training import AdamW, NpzShards, ShuffledBatches, Trainer, build_training, open_data
from gradgen.training.shards import ShardReadError
from tests.test_cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "samples" / "mlp" / "model.onnx"
CNN = ROOT / "samples" / "cnn" / "model.onnx"


def mlp_samples(n: int = 61) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 3)).astype(np.float32)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    return {"x": x, "target": (1 / (1 + np.exp(-x @ w))).astype(np.float32)}


def write_shards(directory: Path, arrays: dict[str, np.ndarray], cuts: list[int]) -> Path:
    """Shards of ``arrays`` split at ``cuts``, alternately uncompressed and compressed (names sort in order)."""
    directory.mkdir()
    bounds = [0, *cuts, len(next(iter(arrays.values())))]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        save = np.savez if i % 2 == 0 else np.savez_compressed
        save(directory / f"part-{i:03d}.npz", **{name: a[lo:hi] for name, a in arrays.items()})
    return directory


@pytest.fixture
def mlp_files(tmp_path):
    arrays = mlp_samples()
    np.savez(tmp_path / "all.npz", **arrays)
    shards = write_shards(tmp_path / "shards", arrays, [9, 9, 30, 31])  # an empty shard, one of 1 sample
    return tmp_path / "all.npz", shards


def test_shards_give_the_batches_of_one_file(tmp_path):
    rng = np.random.default_rng(2)
    arrays = {
        "x": np.asfortranarray(rng.standard_normal((40, 3, 2)).astype(np.float32)),
        "labels": rng.integers(0, 9, 40),
        "mask": rng.random(40) > 0.5,
    }
    shards = write_shards(tmp_path / "d", arrays, [5, 5, 17, 33])
    (shards / "README.txt").write_text("not data")
    (shards / ".part-999.npz").write_bytes(b"temporary")
    data = NpzShards(shards, cache_bytes=1, max_open=2)  # every new shard evicts the others
    assert data.count == 40 and data.counts == [5, 0, 12, 16, 7]
    assert data.ignored == [".part-999.npz", "README.txt"]
    assert data.specs == {"x": (np.dtype(np.float32), (3, 2)), "labels": (np.dtype(np.int64), ()), "mask": (np.dtype(bool), ())}
    for start in (0, 7, 23):
        a = list(itertools.islice(ShuffledBatches(data, 3, seed=5, start=start), 30))
        b = list(itertools.islice(ShuffledBatches(arrays, 3, seed=5, start=start), 30))
        for p, q in zip(a, b):
            assert p.keys() == q.keys()
            assert all(p[k].dtype == q[k].dtype and np.array_equal(p[k], q[k]) for k in p)
    assert len(data._open) <= 2


def test_trainer_over_shards_matches_one_file(mlp_files):
    single, shards = mlp_files
    losses = []
    for data in (open_data(single), open_data(shards)):
        program = build_training(MLP, optimizer=AdamW(weight_decay=0.01), clip_norm=1.0)
        trainer = Trainer(program, lr=0.01)
        losses.append([r.loss for r in trainer.fit(ShuffledBatches(data, 4, seed=3), 40)])
    assert isinstance(open_data(shards), NpzShards)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]


def train_args(data, directory, steps, *extra) -> list:
    return [
        "train",
        MLP,
        "--data",
        data,
        "--lr",
        "0.01",
        "--steps",
        str(steps),
        "--seed",
        "4",
        "--checkpoint-dir",
        directory,
        *extra,
    ]


def checkpoint(path: Path) -> tuple[dict, dict]:
    with np.load(path / "checkpoint.npz") as data:
        return {k: data[k] for k in data.files if k != "meta"}, json.loads(str(data["meta"]))


def test_cli_shards_match_one_file_and_resume_identically(tmp_path, mlp_files, capsys, monkeypatch):
    single, shards = mlp_files
    evaluation = write_shards(tmp_path / "eval", mlp_samples(13), [6])
    (shards / "notes.md").write_text("how these shards were made")
    extra = ["--eval-data", evaluation, "--eval-every", "10", "--checkpoint-every", "7"]
    code, out_file, err = run_cli(capsys, monkeypatch, *train_args(single, tmp_path / "file", 40, *extra))
    assert code == 0, err
    code, out_dir, err = run_cli(capsys, monkeypatch, *train_args(shards, tmp_path / "dir", 40, *extra))
    assert code == 0, err
    assert "ignoring what is not an .npz shard: notes.md" in err
    assert "evaluation uses 12 of the 13 samples" in err
    assert (tmp_path / "file" / "log.csv").read_bytes() == (tmp_path / "dir" / "log.csv").read_bytes()
    a, meta_a = checkpoint(tmp_path / "file")
    b, meta_b = checkpoint(tmp_path / "dir")
    assert meta_a == meta_b and meta_b["data"]["samples"] == 61
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    halves = tmp_path / "halves"
    # Split at an evaluation step: a run's last step is always evaluated, so a split elsewhere adds a row.
    assert run_cli(capsys, monkeypatch, *train_args(shards, halves, 20, *extra))[0] == 0
    code, out, err = run_cli(capsys, monkeypatch, *train_args(shards, halves, 40, *extra, "--resume"))
    assert code == 0, err
    assert "trained steps 21 to 40" in out
    assert (halves / "log.csv").read_bytes() == (tmp_path / "dir" / "log.csv").read_bytes()
    c, meta_c = checkpoint(halves)
    assert meta_c == meta_b and all(np.array_equal(b[k], c[k]) for k in b)

    # A checkpoint made on other data (another number of samples) is refused.
    fewer = write_shards(tmp_path / "fewer", mlp_samples(50), [20])
    code, _, err = run_cli(capsys, monkeypatch, *train_args(fewer, halves, 60, "--resume"))
    assert code == 2 and "another data order (samples in --data 61 -> 50)" in err


def bad_shards(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Directories of shards that must be refused, each with the words its error must hold."""
    arrays = mlp_samples(12)
    cases: dict[str, tuple[Path, str]] = {}

    def case(name, second: dict | bytes, words: str, first: dict | None = None):
        d = tmp_path / name
        d.mkdir()
        np.savez(d / "a.npz", **(first or arrays))
        if isinstance(second, bytes):
            (d / "b.npz").write_bytes(second)
        else:
            np.savez_compressed(d / "b.npz", **second)
        cases[name] = (d, words)

    case(
        "names",
        {"x": arrays["x"], "targets": arrays["target"]},
        "shards b.npz and a.npz hold different arrays: b.npz lacks 'target'; b.npz adds 'targets'",
    )
    case("dtype", {**arrays, "x": arrays["x"].astype(np.float64)}, "array 'x' is float64 in b.npz, float32 in a.npz")
    case("shape", {**arrays, "target": arrays["target"][:, :2]}, "array 'target' has samples of shape [2] in b.npz, [3] in a.npz")
    case("unreadable", b"PK\x03\x04 this is no zip archive", "b.npz: not a readable .npz file")
    case("counts", {**arrays, "x": arrays["x"][:5]}, "b.npz: the arrays hold different numbers of samples")
    case("scalar", {**arrays, "x": np.float32(1)}, "b.npz: array(s) 'x' have no sample axis")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases["empty"] = (empty, "the directory holds no .npz shards")
    others = tmp_path / "others"
    others.mkdir()
    (others / "data.npy").write_bytes(b"")
    cases["others"] = (others, "the directory holds no .npz shards (it holds 1 other file(s) or directories)")
    return cases


def test_bad_shards_are_one_line_errors(tmp_path, capsys, monkeypatch):
    for name, (directory, words) in bad_shards(tmp_path).items():
        with pytest.raises(UsageError, match=None) as info:
            NpzShards(directory)
        assert words in str(info.value) and "\n" not in str(info.value), (name, info.value)
        for option in ("--data", "--eval-data"):
            data = directory if option == "--data" else mlp_files_single(tmp_path)
            extra = ["--eval-data", directory] if option == "--eval-data" else []
            code, _, err = run_cli(capsys, monkeypatch, *train_args(data, tmp_path / f"run-{name}", 3, *extra))
            last = err.strip().splitlines()[-1]
            assert code == 2 and last.startswith(f"error: {option} ") and words in last, (name, option, err)
            assert "Traceback" not in err and not (tmp_path / f"run-{name}" / "checkpoint.npz").exists()


def mlp_files_single(tmp_path: Path) -> Path:
    path = tmp_path / "single.npz"
    if not path.exists():
        np.savez(path, **mlp_samples())
    return path


def test_shards_that_do_not_fit_the_model_name_the_input(tmp_path, capsys, monkeypatch):
    arrays = mlp_samples()
    shards = write_shards(tmp_path / "d", {"x": arrays["x"], "y": arrays["target"]}, [20])
    code, _, err = run_cli(capsys, monkeypatch, *train_args(shards, tmp_path / "run", 3))
    assert code == 4 and "no array for input(s) 'target'" in err.strip().splitlines()[-1]


def test_checkpoint_dir_must_not_be_the_data_directory(mlp_files, capsys, monkeypatch):
    _, shards = mlp_files
    code, _, err = run_cli(capsys, monkeypatch, *train_args(shards, shards, 3))
    assert code == 2 and "is the --data directory" in err
    assert not (shards / "checkpoint.npz").exists()


def test_a_shard_broken_after_opening_is_a_one_line_error(tmp_path):
    arrays = mlp_samples(20)
    shards = write_shards(tmp_path / "d", arrays, [10])
    data = NpzShards(shards, cache_bytes=0, max_open=1)
    assert np.array_equal(data.take(np.arange(20))["x"], arrays["x"])
    assert np.array_equal(data.take(np.array([3]))["x"], arrays["x"][3:4])  # closes shard 1
    (shards / "part-001.npz").write_bytes(b"gone")
    with pytest.raises(ShardReadError, match=r"part-001.npz: shard no longer readable"):
        data.take(np.array([15]))
    assert np.array_equal(data.take(np.array([3]))["x"], arrays["x"][3:4])


def test_a_shard_read_error_while_training_keeps_the_steps_done(mlp_files, tmp_path, capsys, monkeypatch):
    _, shards = mlp_files
    calls = itertools.count(1)
    take = NpzShards.take

    def failing_take(self, rows):
        if next(calls) == 10:
            raise ShardReadError(f"--data {shards / 'part-002.npz'}: shard no longer readable (BadZipFile: gone)")
        return take(self, rows)

    monkeypatch.setattr(NpzShards, "take", failing_take)
    code, _, err = run_cli(capsys, monkeypatch, *train_args(shards, tmp_path / "run", 30))
    last = err.strip().splitlines()[-1]
    assert code == 2 and "part-002.npz: shard no longer readable" in last and "step 9 saved in" in last
    assert checkpoint(tmp_path / "run")[1]["step"] == 9
