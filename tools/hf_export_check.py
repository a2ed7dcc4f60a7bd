"""Does transformers load an --export_hf directory to the suite's own logits? Two steps, in the
two environments (the suite never imports torch):

  python tools/hf_export_check.py suite DIR TOKENS.npy            # the suite's venv: writes
                                                                  # DIR/suite_logits.npy
  HFENV/bin/python tools/hf_export_check.py transformers DIR TOKENS.npy   # torch + transformers

TOKENS.npy: an int [B, S] batch (positions 0..S-1). The first step reads DIR with
modeling/convert.py and runs the single-device reference forward; the second loads DIR with
AutoModelForCausalLM (float32, eager attention) and prints the largest logit difference over the
largest logit (docs/models.md quotes it; the environment: tools/hf_fixtures.py's docstring).
"""
from __future__ import annotations

import os
import sys

import numpy as np


def suite(path: str, tokens: np.ndarray) -> None:
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  from modeling import convert, model
  from modeling.config import Config
  hf = convert.read_config(path)
  b, s = tokens.shape
  cfg = Config(**convert.config_from_hf(hf, batch=b, seq_len=s)).validate()
  params = convert.from_hf(convert.load_safetensors(path), cfg, ignore=convert.mtp_prefixes(hf))
  batch = {"tokens": tokens, "targets": tokens,
           "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()}
  lay = model.reference_layout(cfg)
  logits = jax.jit(lambda p, x: model.forward(p, x, cfg, lay)[0])(params, batch)
  np.save(os.path.join(path, "suite_logits.npy"), np.asarray(logits))
  print(f"wrote {os.path.join(path, 'suite_logits.npy')}")


def transformers_side(path: str, tokens: np.ndarray) -> None:
  import torch
  import transformers
  m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
  with torch.no_grad():
    got = m(input_ids=torch.from_numpy(tokens).long(), use_cache=False).logits.float().numpy()
  want = np.load(os.path.join(path, "suite_logits.npy"))
  err = np.abs(got - want).max() / np.abs(got).max()
  print(f"{path}: transformers {transformers.__version__} loads it as {type(m).__name__}; "
        f"max |logit difference| / max |logit| = {err:.2e}")


if __name__ == "__main__":
  side, directory, token_file = sys.argv[1:4]
  toks = np.load(token_file).astype(np.int32)
  {"suite": suite, "transformers": transformers_side}[side](directory, toks)
