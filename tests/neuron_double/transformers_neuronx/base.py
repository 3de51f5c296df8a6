"""Test double of ``transformers_neuronx/base.py`` (aws-neuron/transformers-neuronx, 0.13.x):
``NeuronModelBase``, the top-level model API.

* ``to_neuron()``: start the runtime (``ops.init()``: this process takes its NeuronCores,
  ``RuntimeError`` if another live process holds one), read the weights (into an HF model,
  float32 whatever ``amp``), build the graphs (continuous batching with one sequence fails
  here, as the real context-insert HLO does), then either read the artifacts of
  ``load(dir)`` (``FileNotFoundError`` on a hash miss, as in the real ``set_neff_bytes``) or
  ``compile()`` every graph through the simulated persistent cache (``compiler.py``), then
  ``setup()``.
* Graphs: one context-encoding graph per (context bucket x context batch size) and one
  token-generation graph per (n_positions bucket x batch size).
* ``save(dir)`` writes one file per graph named ``hash_hlo(hlo_module)`` (sha256 of the
  serialized HLO, 20 hex digits, ``.neff``; flags not included); ``load(dir)`` only records ``dir``.
* ``reset()`` zeroes every layer's KV cache from the host in the real SDK (``ops.parallel_write``
  of zeros for k and v, every layer, every batch size); the double counts the calls
  (``reset_calls``) and the bytes a real reset would write (``reset_bytes``).
* ``forward`` checks what the real runtime would trip on (uncompiled batch size, a cache
  position past ``max(n_positions)``) and delegates numerics to ``decoder.HFDecoder``.
"""
import math
import os
import time

import hashlib

import torch

from transformers_neuronx import bucket, compiler, module, ops, sampling
from transformers_neuronx.constants import GQA
from transformers_neuronx.decoder import HFDecoder

#: NeuronConfig fields that do not change the compiled graphs.
_NON_HLO_FIELDS = {"compilation_worker_count", "dist", "rank_id", "local_tp", "layer_partition", "num_layers"}


#: Bytes per KV-cache element for each ``amp`` (the cache has the amp dtype).
_AMP_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def hash_hlo(hlo_module):
    """As the real ``base.hash_hlo``: the ``save()``/``load()`` file name of one graph."""
    hash_gen = hashlib.sha256()
    hash_gen.update(compiler.serialize(hlo_module))
    return str(hash_gen.hexdigest())[:20] + '.neff'


class NeuronModelBase(module.PretrainedModel):
    """Shared top-level API; subclasses set the buckets, configs and ``_hf_model_class``."""

    def _init_runtime_state(self):
        self.compile_log = []
        self.slow_context_encodings = 0
        self.reset_calls = 0
        self.reset_bytes = 0
        self.neuron_cores = []
        self.ignored_sample_kwargs = {}
        self._neffs = {}
        self._graph_files = []
        self._decoder = None
        self._generation_config = self.neuron_config.on_device_generation

    # ---- top-level API -------------------------------------------------------------

    def to_neuron(self):
        self._neffs, self._graph_files, self.compile_log = {}, [], []
        self.neuron_cores = ops.init()
        self._check_cores()
        self._load_weights()
        self._build_hlo()
        if hasattr(self, "_compiled_artifacts_directory"):
            self._load_compiled_artifacts(self._compiled_artifacts_directory)
        else:
            self.compile(parallel_degree=self.neuron_config.compilation_worker_count)
        self.setup()

    def compile(self, parallel_degree=None):
        """Compile every graph through the persistent cache.

        Misses cost ``FAKE_NEURON_COMPILE_SECONDS`` each, ``parallel_degree`` at a time
        (default: all graphs at once, like the real ``ProcessPoolExecutor``).
        """
        graphs = self._graphs()
        misses = 0
        for kind, bucket, batch_size in graphs:
            hlo_module = self._hlo_description(kind, bucket, batch_size)
            hlo_hash, neff, module_dir, hit = compiler.compile_description(hlo_module)
            self._record(kind, bucket, batch_size, hlo_hash, hash_hlo(hlo_module), neff, module_dir, hit)
            misses += not hit
        seconds = float(os.environ.get("FAKE_NEURON_COMPILE_SECONDS", "0") or 0)
        if misses and seconds > 0:
            time.sleep(seconds * math.ceil(misses / (parallel_degree or len(graphs))))

    def setup(self):
        self._decoder = HFDecoder(self._hf, max(self.token_buckets))

    def save(self, directory, sharded_weights=False):
        if sharded_weights:
            raise ValueError("the Neuron test double does not emulate presharded weights (sharded_weights=True)")
        if os.path.isfile(directory):
            raise FileExistsError(f'Artifacts should be saved to a directory. Found existing file: {directory}')
        assert self.is_compiled(), "cannot save a model which has not been successfully compiled"
        os.makedirs(directory, exist_ok=True)
        for name in self._graph_files:
            with open(os.path.join(directory, name), 'wb') as f:
                f.write(self._neffs[name])

    def load(self, directory):
        self._compiled_artifacts_directory = directory

    def is_compiled(self):
        return bool(self._graph_files) and all(h in self._neffs for h in self._graph_files)

    def reset(self):
        """Zero every KV cache. On the device this is a host-to-device write of all of them
        (``kv_cache_bytes()``), and no upstream sampling loop calls it: stale entries are masked."""
        self.reset_calls += 1
        if self._decoder is not None:
            self.reset_bytes += self.kv_cache_bytes()
            self._decoder.reset()

    def kv_cache_bytes(self):
        """What one real ``reset()`` writes: layers x (k, v) x every batch size's cache.

        Cache shape as the real ``DecoderLayer.init_caches`` (SBH): ``[max(n_positions), batch,
        KV heads padded to a multiple of tp_degree (not with shard-over-batch), head size]``
        in the ``amp`` dtype.
        """
        cfg = self.config
        kv_heads = cfg.num_key_value_heads
        if self.neuron_config.group_query_attention != GQA.SHARD_OVER_BATCH:
            kv_heads = math.ceil(kv_heads / cfg.tp_degree) * cfg.tp_degree
        per_row = max(self.token_buckets) * kv_heads * cfg.attention_head_size * _AMP_BYTES[cfg.amp]
        return cfg.num_hidden_layers * 2 * sum(batch * per_row for batch in self.batch_sizes)

    def update_generation_config(self, generation_config):
        self._generation_config = generation_config

    # ---- compilation internals -----------------------------------------------------

    def _graphs(self):
        """``(kind, bucket, batch_size)`` of every graph the real model would compile."""
        context = [("context", b, n) for b in self.context_buckets for n in self.context_batch_sizes]
        token = [("token", b, n) for b in self.token_buckets for n in self.batch_sizes]
        return context + token

    def _hlo_description(self, kind, bucket, batch_size):
        """Everything that shapes the real HLO of one graph."""
        cfg = self.config
        neuron = {k: v for k, v in self.neuron_config.to_json().items() if k not in _NON_HLO_FIELDS}
        return {
            "graph": kind, "bucket": bucket, "batch_size": batch_size,
            "n_positions": max(self.token_buckets), "tp_degree": cfg.tp_degree, "amp": cfg.amp,
            "unroll": self.context_unroll if kind == "context" else self.unroll,
            "model": {k: getattr(cfg, k) for k in (
                "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling")},
            "neuron_config": neuron,
        }

    def _record(self, kind, bucket, batch_size, hlo_hash, neff_file, neff, module_dir, hit):
        self._neffs[neff_file] = neff
        self._graph_files.append(neff_file)
        self.compile_log.append({"graph": kind, "bucket": bucket, "batch_size": batch_size, "module_dir": module_dir,
                                 "hit": hit, "hlo_hash": hlo_hash, "neff_file": neff_file})

    def _build_hlo(self):
        """Checks the real HLO builders make while ``load_weights()`` builds every graph.

        Continuous batching: the context graph writes one prompt into a KV cache of
        ``max_num_seqs`` sequences (``layers/attention.py`` ``fused_kv_update_cache``, 2-D
        ``cache_ids``). Its insert branch needs ``n_seqs > n_active_seqs`` (here 1); with one
        sequence no branch matches and the real code raises ``NotImplementedError``.
        """
        cb = self.neuron_config.continuous_batching
        if not cb or not self.context_buckets:
            return
        n_seqs, size = cb.batch_size_for_shared_caches, min(self.context_buckets)
        if n_seqs <= 1:
            raise NotImplementedError(f"Updating 2D cache_ids is not implemented for n_active_tokens={size}, "
                                      f"n_positions={size}, n_seqs={n_seqs}, n_active_seqs=1.")

    def _load_compiled_artifacts(self, directory):
        if not os.path.isdir(directory):
            raise FileNotFoundError(f'Did not find directory: {directory}.')
        for kind, bucket, batch_size in self._graphs():
            hlo_module = self._hlo_description(kind, bucket, batch_size)
            neff_file = hash_hlo(hlo_module)
            path = os.path.join(directory, neff_file)
            try:
                with open(path, 'rb') as f:
                    neff = f.read()
            except FileNotFoundError:
                raise FileNotFoundError(
                    'Could not find a matching NEFF for your HLO in this directory. Ensure that the model you '
                    'are trying to load is the same type and has the same parameters as the one you saved or '
                    f'call "save" on this model to reserialize it. (missing: {path})') from None
            compiler.compiler_stats["loaded"] += 1
            self._record(kind, bucket, batch_size, compiler.get_hash_module(hlo_module, None), neff_file, neff, path,
                         True)

    def _check_cores(self):
        """A model sharded over more cores (tp_degree) than the runtime gave this process cannot load."""
        tp, got = self.config.tp_degree, len(self.neuron_cores)
        if got < tp:
            source = next((f"{var}={os.environ[var]}" for var in ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES")
                           if os.environ.get(var)), "this host")
            raise RuntimeError(f"{source} gives this process {got} NeuronCore(s), but the model needs tp_degree={tp}")

    def _load_weights(self):
        if not hasattr(self, "_checkpoint"):
            raise RuntimeError("no checkpoint: build the model with from_pretrained() before to_neuron()")
        state_dict = module.read_state_dict(*self._checkpoint)
        self._hf = self._hf_model_class.from_pretrained(
            None, config=self._hf_config, state_dict=state_dict, torch_dtype=torch.float32).eval()

    # ---- execution internals -------------------------------------------------------

    def _require_ready(self):
        if self._decoder is None:
            raise RuntimeError(f"{type(self).__name__}: call to_neuron() before forward()/sample()")

    def _note_context(self, length):
        """A prompt longer than the largest context bucket is encoded partly token by token."""
        if not self.context_buckets or length > max(self.context_buckets):
            self.slow_context_encodings += 1

    def _embeddings(self, input_embeddings):
        """Caller-made embeddings in the configured attention layout, as ``[B, T, H]``."""
        if input_embeddings is None:
            return None
        if self.neuron_config.attention_layout == "HSB":
            return input_embeddings.transpose(0, -1)
        return input_embeddings

    def _forward_impl(self, input_ids, cache_ids, start_ids, last_token_id, input_embeddings):
        self._require_ready()
        # Without last_token_id the real forward embeds input_ids itself (input_embeddings unused).
        embeds = self._embeddings(input_embeddings) if last_token_id is not None else None
        if self.neuron_config.continuous_batching and start_ids is not None:
            logits = self._forward_continuous(input_ids, embeds, cache_ids, start_ids)
        else:
            logits = self._forward_static(input_ids, embeds, cache_ids, start_ids, last_token_id)
        logits = logits.to(getattr(torch, self.neuron_config.cast_logits_dtype))
        if self.neuron_config.on_device_generation:
            return self._select_on_device(logits)
        return logits

    def _forward_static(self, input_ids, embeds, cache_ids, start_ids, last_token_id):
        rows, length = input_ids.shape
        if rows not in self.batch_sizes:
            raise ValueError(f"Model not compiled for batch_size : {rows}. "
                             f"Acceptable batch_size is one of the following {self.batch_sizes}")
        start_ids = torch.zeros(rows, dtype=torch.long) if start_ids is None else start_ids.flatten().long()
        positions = torch.arange(length) if cache_ids is None else self._static_positions(cache_ids)
        if length > 1 and int(positions[0]) > 0:
            raise ValueError("multi-token forward() at cache position > 0 is speculative decoding; "
                             "no speculation graphs were compiled (enable_speculative_decoder)")
        if self.prefixed_length:
            positions = positions + self.prefixed_length
        if length > 1 and last_token_id is not None:
            keep = int(last_token_id.flatten()[0]) + 1  # the rest is bucket padding
            input_ids, positions = input_ids[:, :keep], positions[:keep]
            embeds = None if embeds is None else embeds[:, :keep]
        if length > 1:
            self._note_context(input_ids.shape[1])
        return self._decoder.run_static(input_ids, embeds, positions, start_ids)

    @staticmethod
    def _static_positions(cache_ids):
        cache_ids = torch.as_tensor(cache_ids).long()
        if cache_ids.dim() == 2:
            if not bool((cache_ids == cache_ids[:1]).all()):
                raise ValueError("per-row cache_ids need NeuronConfig(continuous_batching=...) in the double")
            cache_ids = cache_ids[0]
        return cache_ids.flatten()

    def _forward_continuous(self, input_ids, embeds, cache_ids, seq_ids):
        """Continuous batching, as the real ``base.py`` runs it without paged attention (SBH cache).

        Mirrors ``_prepare_for_continuous_batching``, ``_context_dynamic_batching`` and
        ``_postprocess``:

        * several tokens with ``cache_ids[0][0] == 0``: context encoding, one sequence at a
          time (context batch size 1), each row right-padded to the context bucket that fits
          it; the graph writes positions ``0..bucket-1`` of slot ``seq_ids[i]`` and returns the
          logits at ``max(cache_ids[i])``; a row longer than the largest bucket is an
          ``AssertionError``;
        * several tokens at a position > 0: the speculative branch; without speculation
          graphs the real code fails an assertion, so does the double;
        * one token per row: token generation over the full ``max_num_seqs`` batch; rows are
          scattered to their slot, every slot without a row gets token 0 at position 0
          (which overwrites position 0 of that slot's cache), and the logits come back in
          the order of ``seq_ids``.
        """
        slots = self.neuron_config.continuous_batching.batch_size_for_shared_caches
        seq_ids = torch.as_tensor(seq_ids)
        flat = seq_ids.flatten().long()
        n_seqs, n_active = input_ids.shape
        if n_seqs > slots or bool(((flat < 0) | (flat >= slots)).any()):
            raise ValueError(f"continuous batching: {n_seqs} rows with sequence ids {flat.tolist()} "
                             f"do not fit the {slots} compiled KV-cache slots")
        if cache_ids is None:
            # The real code reads cache_ids.flatten() here: an AttributeError on None.
            raise TypeError("continuous batching needs cache_ids (2-D, one row per sequence)")
        cache_ids = torch.as_tensor(cache_ids)
        if embeds is not None:
            raise ValueError("the Neuron test double does not emulate input_embeddings with continuous batching")
        if n_active > 1 and int(cache_ids.flatten()[0]) == 0:
            return self._continuous_context(input_ids, cache_ids, flat)
        if n_active > 1:
            n_positions = bucket.find(self.context_buckets, n_active)
            assert n_active <= n_positions, f"invalid input prompt length ({n_active} <= {n_positions})"
            assert False, (f"invalid batch size for speculative forward ({n_seqs} not in []): a multi-token "
                           "forward() at a cache position > 0 needs speculation graphs")
        return self._continuous_token(input_ids, cache_ids, seq_ids, flat, slots)

    def _continuous_context(self, input_ids, cache_ids, seq_ids):
        n_seqs, n_active = input_ids.shape
        size = bucket.find(self.context_buckets, n_active)
        if size is None:
            raise TypeError("'<=' not supported between instances of 'int' and 'NoneType' (no context buckets)")
        assert n_seqs == cache_ids.shape[0], f"invalid n_active_seqs ({n_seqs} vs {cache_ids.shape[0]})"
        assert n_active <= size, f"invalid input prompt length ({n_active} <= {size})"
        if cache_ids.dim() != 2:
            raise ValueError(f"continuous batching needs 2-D cache_ids [n_seqs, n_tokens], got {tuple(cache_ids.shape)}")
        out = []
        for row in range(n_seqs):
            last = int(cache_ids[row, :n_active].max())  # the real last_token_id
            positions = cache_ids[row, :last + 1].long()
            if not torch.equal(positions, torch.arange(last + 1)):
                raise ValueError("the context graph writes positions 0..bucket-1 in order; cache_ids must be "
                                 f"0..n-1 then padding, got {cache_ids[row].tolist()}")
            out.append(self._decoder.encode_slot(int(seq_ids[row]), input_ids[row:row + 1, :last + 1], size))
        return torch.cat(out, dim=0)

    def _continuous_token(self, input_ids, cache_ids, seq_ids, flat, slots):
        if len(set(flat.tolist())) != len(flat):
            raise ValueError(f"sequence ids {flat.tolist()} repeat a slot: the real scatter would keep one "
                             "row and silently drop the other")
        # As the real code: zero-padded full batch, rows scattered by sequence id (scatter_
        # needs cache_ids [n, 1] of input_ids' dtype).
        full_input_ids = torch.zeros(slots, 1, dtype=input_ids.dtype)
        full_cache_ids = torch.zeros(slots, 1, dtype=input_ids.dtype)
        index = seq_ids.flatten().unsqueeze(-1).to(torch.int64)
        full_input_ids.scatter_(dim=0, index=index, src=input_ids)
        full_cache_ids.scatter_(dim=0, index=index, src=cache_ids)
        logits = torch.cat([self._decoder.decode_slot(s, full_input_ids[s], int(full_cache_ids[s, 0]))
                            for s in range(slots)], dim=0)
        if torch.equal(flat, torch.arange(len(flat))):
            return logits[:len(flat)]
        return logits[flat]

    def _select_on_device(self, logits):
        """On-device generation: the graph returns the chosen tokens ``[B, 1]``."""
        cfg = self._generation_config
        if not cfg.do_sample:
            return torch.argmax(logits, dim=-1, keepdim=True)

        def pick(value, row):
            return value[row] if isinstance(value, list) else value

        rows = [sampling.select_tokens(logits[r:r + 1] / pick(cfg.temperature, r),
                                       top_k=pick(cfg.top_k, r), top_p=pick(cfg.top_p, r))
                for r in range(logits.shape[0])]
        return torch.cat(rows, dim=0)
