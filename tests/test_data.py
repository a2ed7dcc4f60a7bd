"""--data=PATH (runtime/data.py): a token file read by memory map. Batch `step` is a pure function
of (file, seed, step, batch, seq_len), an epoch visits every window once, the formats give the
same batches for the same tokens, bad input is one `error:` line (exit 2) before anything
compiles, and a strategy trains on real bytes and equals the reference there."""
import json
import os

import numpy as np
import pytest

from modeling.config import ConfigError, get_config
from runtime import data
from tests.conftest import one_error_line, run_py_in_one_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bin(path, toks, dtype=np.uint16) -> str:
  np.asarray(toks, dtype).tofile(path)
  return str(path)


def _npy(path, toks) -> str:
  np.save(path, toks)
  return str(path)


def _starts(b, seq_len):
  """The window index of each sequence of a batch over tokens arange(N): its first token / S."""
  return (b["tokens"][:, 0] // seq_len).tolist()


def test_batch_is_pure_seeded_and_covers_every_window(tmp_path):
  S, B, W = 4, 8, 20                                  # 2.5 steps per epoch: a batch straddles two
  path = _bin(tmp_path / "t.bin", np.arange(W * S + 3))   # + 3: a tail shorter than a window
  assert data.windows(path, S) == W
  b0 = data.file_batch(path, 0, B, S, seed=0)
  syn = data.batch(0, B, S, 256, 0)
  assert set(b0) == set(syn)
  for k in b0:
    assert b0[k].dtype == np.int32 and b0[k].shape == (B, S), k
    np.testing.assert_array_equal(b0[k], data.file_batch(path, 0, B, S, seed=0)[k])
  np.testing.assert_array_equal(b0["targets"][:, :-1], b0["tokens"][:, 1:])
  np.testing.assert_array_equal(b0["targets"][:, -1], b0["tokens"][:, -1] + 1)
  np.testing.assert_array_equal(b0["positions"], syn["positions"])
  assert not np.array_equal(b0["tokens"], data.file_batch(path, 0, B, S, seed=1)["tokens"])
  # 5 steps = 40 sequences = 2 epochs: each window twice, each epoch every window once
  seen = sum((_starts(data.file_batch(path, i, B, S, seed=0), S) for i in range(5)), [])
  first, second = seen[:W], seen[W:]
  assert sorted(first) == sorted(second) == list(range(W))
  assert first != second and first != list(range(W))   # shuffled, and anew each epoch


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 1000, 4099])
def test_permute_is_a_bijection(n):
  p = data.permute(np.arange(n), n, seed=3, epoch=5)
  assert sorted(p.tolist()) == list(range(n))
  np.testing.assert_array_equal(data.permute(np.arange(n)[::-1], n, 3, 5), p[::-1])


def test_formats_give_the_same_batches_from_a_memory_map(tmp_path):
  toks = np.random.default_rng(0).integers(0, 1000, size=517)
  paths = [_bin(tmp_path / "a.bin", toks), _bin(tmp_path / "a.u32.bin", toks, np.uint32),
           _npy(tmp_path / "a16.npy", toks.astype(np.uint16)),
           _npy(tmp_path / "a64.npy", toks.astype(np.int64))]
  for p in paths:
    assert isinstance(data.tokens(p), np.memmap)
    assert data.tokens(p) is data.tokens(p)             # opened once, cached per file
  ref = [data.file_batch(paths[0], i, 4, 16, seed=7) for i in range(3)]
  for p in paths[1:]:
    for i, r in enumerate(ref):
      for k in r:
        np.testing.assert_array_equal(data.file_batch(p, i, 4, 16, seed=7)[k], r[k], err_msg=p)


def test_token_range_scans_in_chunks(tmp_path, monkeypatch):
  toks = np.arange(100) % 37
  toks[61] = 999
  path = _bin(tmp_path / "r.bin", toks)
  monkeypatch.setattr(data, "SCAN_CHUNK", 7)
  data._range.cache_clear()
  assert data.token_range(path) == (0, 999)
  with pytest.raises(ConfigError, match="token id 999 >= the model's vocab 256"):
    data.check(path, 8, 256)
  data.check(path, 8, 1000)


def test_batch_for_dispatches_on_cfg_data(tmp_path):
  cfg = get_config("tiny", seed=2)
  b, syn = data.batch_for(cfg, 3), data.batch(3, cfg.batch, cfg.seq_len, cfg.vocab, 2)
  assert all(np.array_equal(b[k], syn[k]) for k in syn)
  path = _bin(tmp_path / "d.bin", np.arange(1000) % cfg.vocab)
  b = data.batch_for(cfg.replace(data=path), 3)
  ref = data.file_batch(path, 3, cfg.batch, cfg.seq_len, 2)
  assert all(np.array_equal(b[k], ref[k]) for k in ref)


# --- run.py: bad input (exit 2, one line) and real data end to end, in one process -------------

def _files(d) -> dict:
  """The bad rows' files, and README.md's bytes as uint16 tokens (vocab 256: `tiny`'s)."""
  readme = np.frombuffer(open(os.path.join(ROOT, "README.md"), "rb").read(), np.uint8)
  out = {"readme": _bin(d / "readme.bin", readme), "empty": _bin(d / "empty.bin", []),
         "short": _bin(d / "short.bin", np.arange(32)),         # tiny: seq 32 needs 33 tokens
         "vocab": _bin(d / "vocab.bin", np.r_[np.arange(100), 256]),
         "2d": _npy(d / "two.npy", np.zeros((10, 10), np.int32)),
         "float": _npy(d / "float.npy", np.zeros(100, np.float32)),
         "negative": _npy(d / "neg.npy", np.r_[np.arange(100), -1]),
         "txt": str(d / "readme.txt"), "dir": str(d)}
  with open(d / "odd.bin", "wb") as f:
    f.write(b"\x01\x00\x02")
  out["odd"] = str(d / "odd.bin")
  with open(out["txt"], "wb") as f:
    f.write(readme.tobytes())
  return out


BAD = [("missing", "missing", "No such file or directory"),
       ("empty", "empty", "holds no token"),
       ("odd", "odd", "3 bytes is not a whole number of uint16 tokens"),
       ("short", "short", "holds 32 tokens, fewer than seq_len + 1 = 33"),
       ("vocab", "vocab", "holds token id 256 >= the model's vocab 256"),
       ("negative", "negative", "holds token id -1 < 0"),
       ("2d", "2d", "a .npy token file must be 1-D integer, this one is 2-D int32"),
       ("float", "float", "must be 1-D integer, this one is 1-D float32"),
       ("txt", "txt", "unknown token file format: expected NAME.bin"),
       ("dir", "dir", "is not a file")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  d = tmp_path_factory.mktemp("data")
  files = _files(d)
  files["missing"] = str(d / "no_such.bin")
  rows = {name: ["--strategy=ep", f"--data={files[key]}"] for name, key, _ in BAD}
  rows["train"] = ["--strategy=ep", f"--data={files['readme']}", "--steps=6",
                   f"--metrics_file={d / 'm.jsonl'}"]
  rows["compare"] = ["--compare=reference,ep", f"--data={files['readme']}", "--steps=2"]
  rows["synthetic"] = ["--strategy=reference", "--steps=0", f"--metrics_file={d / 's.jsonl'}"]
  return d, files, run_py_in_one_process(rows)


@pytest.mark.parametrize("name, says", [(n, s) for n, _, s in BAD], ids=[n for n, _, _ in BAD])
def test_bad_data_is_one_line_error(runs, name, says):
  code, out, err = runs[2][name]
  line = one_error_line(code, err, "error: --data=")
  assert says in line, line
  assert "compiled" not in out                            # refused before anything compiles


def test_real_bytes_train_and_equal_the_reference(runs):
  d, files, res = runs
  code, out, err = res["train"]
  assert code == 0, out + err
  recs = [json.loads(l) for l in (d / "m.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in recs[:-1]]
  assert len(losses) == 6 and losses[-1] < losses[0], losses
  assert recs[-1]["summary"] and recs[-1]["data"] == files["readme"]
  code, out, err = res["compare"]                         # exit 0: every row PASS (compare.outcome)
  assert code == 0, out + err
  assert f"data {files['readme']}" in out
  row = [l for l in out.splitlines() if l.startswith("| ep ")]
  assert row and "PASS" in row[0], out


def test_synthetic_chain_is_the_default(runs):
  d, _, res = runs
  code, out, err = res["synthetic"]
  assert code == 0, out + err
  assert json.loads((d / "s.jsonl").read_text().splitlines()[-1])["data"] == "synthetic"
