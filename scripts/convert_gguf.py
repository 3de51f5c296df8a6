#!/usr/bin/env python3
"""Run llama.cpp's ``convert_hf_to_gguf.py`` on the bench model, naming its BPE pre-tokenizer.

    python scripts/convert_gguf.py --tree build/peers/llama.cpp build/bench-model-bf16 \\
        --outfile build/peers/bench-model-bf16.gguf --outtype bf16

``convert_hf_to_gguf.py`` recognises a byte-level BPE tokenizer's pre-tokenizer by hashing
how it encodes a fixed test string, against a table generated (by
``convert_hf_to_gguf_update.py``, which downloads each known model's tokenizer) for published
models. The bench model's tokenizer is the project's own (``scripts/build_tiny_llama.py``), so
its hash is in no table and the converter stops with "BPE pre-tokenizer was not recognized".

Its pre-tokenizer is GPT-2's: a ``ByteLevel`` pre-tokenizer with ``use_regex: true`` (GPT-2's
split regex), no prefix space and no normalizer. llama.cpp implements that as ``tokenizer.ggml.pre
= "gpt-2"``. So this runs the tree's converter unchanged and, only when the hash lookup fails,
answers ``--tokenizer-pre`` (default ``gpt-2``) instead of raising, after checking that
``tokenizer.json`` really has GPT-2's pre-tokenizer (``--tokenizer-pre`` given explicitly skips
that check). Nothing in the llama.cpp tree is modified. Every other argument goes to the
converter as is. The peers are sent token ids, so the tokenizer only matters for the text
llama-server streams back.
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path
from typing import List, Optional, Tuple


def gpt2_pretokenizer(tokenizer_json: dict) -> Tuple[bool, str]:
    """(True, why) when a tokenizers ``tokenizer.json`` pre-tokenizes exactly as GPT-2 does."""
    if (tokenizer_json.get("model") or {}).get("type") != "BPE":
        return False, f"model type {(tokenizer_json.get('model') or {}).get('type')!r}, not BPE"
    if tokenizer_json.get("normalizer") is not None:
        return False, f"has a normalizer ({tokenizer_json['normalizer'].get('type')})"
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers") or []) == 1:
        pre = pre["pretokenizers"][0]
    if pre.get("type") != "ByteLevel":
        return False, f"pre-tokenizer {pre.get('type')!r}, not ByteLevel"
    if not pre.get("use_regex", True):
        return False, "ByteLevel without its regex split"
    if pre.get("add_prefix_space", False):
        return False, "ByteLevel with add_prefix_space"
    return True, "ByteLevel with GPT-2's regex, no prefix space, no normalizer"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)
    parser.add_argument("--tree", type=Path, required=True, help="the llama.cpp source tree")
    parser.add_argument("--tokenizer-pre", help="tokenizer.ggml.pre to write when the hash is unknown "
                                                "(default: gpt-2, after checking tokenizer.json)")
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):  # add_help is off so that the converter's own flags pass through
        parser.print_help()
        print("\nEvery other argument goes to <tree>/convert_hf_to_gguf.py (see its --help).")
        return 0
    args, rest = parser.parse_known_args(argv)
    model_dirs = [Path(a) for a in rest if not a.startswith("-") and Path(a).is_dir()]
    if not model_dirs:
        parser.error("no model directory among the converter's arguments")
    explicit = args.tokenizer_pre is not None
    tokenizer_pre = args.tokenizer_pre or "gpt-2"
    tree = args.tree.resolve()
    script = tree / "convert_hf_to_gguf.py"
    if not script.is_file():
        parser.error(f"no {script}")

    sys.path.insert(0, str(tree))
    sys.path.insert(1, str(tree / "gguf-py"))
    from conversion import base  # the tree's converter package (llama.cpp after its split of convert_hf_to_gguf.py)

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not explicit:
                path = Path(self.dir_model) / "tokenizer.json"
                ok, why = gpt2_pretokenizer(json.loads(path.read_text()))
                if not ok:
                    raise SystemExit(f"convert_gguf: unknown BPE pre-tokenizer and {path} is not GPT-2's ({why}); "
                                     "pass --tokenizer-pre to name the matching llama.cpp pre-tokenizer") from None
                base.logger.warning(f"unknown pre-tokenizer hash; {path}: {why}: writing tokenizer.ggml.pre = {tokenizer_pre!r}")
            else:
                base.logger.warning(f"unknown pre-tokenizer hash: writing tokenizer.ggml.pre = {tokenizer_pre!r} (--tokenizer-pre)")
            return tokenizer_pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(script)] + rest
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
