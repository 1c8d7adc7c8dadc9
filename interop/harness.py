"""lm-evaluation-harness on this repo's ``Transformer``, in memory.

``HarnessModel`` is an lm-eval ``TemplateLM`` over our model and the run's tokenizer, so
``lm_eval.simple_evaluate(model=HarnessModel(...), tasks=[...])`` scores a trained model
without exporting it. It handles tokens as lm-eval's own ``hf`` backend does on the
``launch/convert_hf.py export`` of the same weights (``tests/interop/test_harness.py`` holds the
two equal):

- log-likelihood: lm-eval's ``TemplateLM.loglikelihood`` splits context and continuation
  (trailing spaces move to the continuation; an empty context becomes the prefix token, the
  tokenizer's BOS or else EOS); ``_loglikelihood_tokens`` scores ``(context +
  continuation)[-(max_length + 1):][:-1]`` (left truncation) and sums the continuation's log
  probabilities, with ``is_greedy`` when each continuation token is the argmax;
- rolling log-likelihood (perplexity tasks): the text's tokens cut into disjoint windows of
  ``max_length`` (lm-eval's ``get_rolling_token_windows`` with the prefix token, context 1),
  summed;
- greedy generation until a stop string, the context left-truncated to ``max_length -
  max_gen_toks``.

``max_length`` is the model's ``max_seq_len`` (the export's ``max_position_embeddings``).
Written here because lm-eval's backends all load a model from a path or hub name; this one takes
the live module. lm-eval is imported by the evaluation code only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM


class HarnessModel(TemplateLM):
    """Our ``Transformer`` (``model``, its ``cfg``) and ``tokenizer`` as an lm-eval model.

    Args:
        model: the model (eval mode is set; its device is used).
        tokenizer: the run's transformers tokenizer.
        batch_size: sequences per forward pass.
        max_gen_toks: the default generation length (lm-eval's ``hf`` default, 256).
    """

    def __init__(self, model, tokenizer, batch_size: int = 8, max_gen_toks: int = 256):
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self._max_gen_toks = max_gen_toks
        self._device = next(model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            special = {"add_special_tokens": False}        # as the hf backend: BOS already there
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def _log_probs(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """Log-softmax over the vocabulary at every position of each input (right-padded
        batches: a causal model's earlier positions never see the padding)."""
        out = []
        for i in range(0, len(inputs), self.batch_size):
            chunk = inputs[i:i + self.batch_size]
            width = max(map(len, chunk))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, seq in enumerate(chunk):
                ids[row, :len(seq)] = torch.tensor(seq)
            logits = self.model(ids.to(self._device)).logits.float()
            out += [torch.log_softmax(logits[row, :len(seq)], dim=-1).cpu() for row, seq in enumerate(chunk)]
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        inputs, conts = [], []
        for _, context_enc, continuation_enc in requests:
            inputs.append((context_enc + continuation_enc)[-(self.max_length + 1):][:-1])
            conts.append(continuation_enc)
        results = []
        for log_probs, cont in zip(self._log_probs(inputs), conts):
            scores = log_probs[-len(cont):]
            target = torch.tensor(cont)
            greedy = bool((scores.argmax(dim=-1) == target).all())
            results.append((float(scores.gather(1, target[:, None]).sum()), greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in (req.args for req in requests):
            windows = [(None,) + lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            out.append(sum(ll for ll, _ in self._loglikelihood_tokens(windows)))
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs or {})
            until = kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", self._max_gen_toks))
            ids = self.tok_encode(context)[-(self.max_length - new):]
            generated: list[int] = []
            for _ in range(new):
                window = (ids + generated)[-self.max_length:]
                logits = self.model(torch.tensor([window], device=self._device)).logits[0, -1]
                token = int(logits.argmax())
                if token == self.eot_token_id:
                    break
                generated.append(token)
                if any(stop in self.tok_decode(generated) for stop in until):
                    break
            text = self.tok_decode(generated)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def run_tasks(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: int | None = None,
              num_fewshot: int | None = None, batch_size: int = 8) -> dict:
    """``lm_eval.simple_evaluate`` of ``tasks`` on ``model`` in memory; lm-eval's dict (its
    top-level ``results`` included). Tasks found under ``include_path`` alone are looked up
    there without indexing lm-eval's own. ValueError (one line) for an unknown task, or for a
    task whose dataset must be downloaded while the machine is offline."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_defaults=False, include_path=include_path) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path)       # lm-eval's own ~15k tasks: ~8 s to index
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" (nor under --include-path {include_path})" if include_path else ""
        raise ValueError(f"--tasks: unknown task {unknown[0]!r}{where}: name one of lm-eval's tasks, or "
                         f"point --include-path at the folder of its YAML")
    try:
        return lm_eval.simple_evaluate(model=HarnessModel(model, tokenizer, batch_size), tasks=tasks,
                                       task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                       bootstrap_iters=0)
    except (ConnectionError, OSError) as err:          # datasets' hub download, offline
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"--tasks {','.join(tasks)}: a task's dataset could not be loaded ({first[:200]}); "
                         f"on an offline machine (HF_DATASETS_OFFLINE=1) use tasks with local data files "
                         f"(--include-path), or download the dataset where there is a network first") from None


def save_results(results: dict, out_dir, step: int) -> Path:
    """Write ``results`` to a new ``out_dir/lm_eval_<step>_<UTC time>.json`` (never an
    existing file); returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1000):
        path = out_dir / f"lm_eval_{step:08d}_{stamp}{f'_{n}' if n else ''}.json"
        try:
            with open(path, "x", encoding="utf-8") as f:
                json.dump(results, f, indent=1, default=lm_utils.handle_non_serializable)
            return path
        except FileExistsError:
            continue
    raise ValueError(f"{out_dir}: no free results file name for step {step}")
