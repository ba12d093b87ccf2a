"""klpen inside TRL's ``GRPOTrainer``: klpen computes the log-probs, the entropy and the KL term.

Run it (a CPU and a few seconds; nothing is downloaded, the model and the tokenizer are built
here)::

    python examples/trl_grpo.py            # klpen's terms
    python examples/trl_grpo.py --stock    # TRL's own, for comparison
    python examples/trl_grpo.py --bf16     # both in bf16 autocast

Each run prints one JSON line per logged step (TRL's own log: ``loss``, ``kl``, ``entropy``, …).

What klpen replaces, and nothing else (TRL 1.16):

- ``GRPOTrainer._get_per_token_logps_and_entropies``: TRL patches the model with a fused LM head
  that scores the completion tokens from the hidden states in tiles. Here the backbone gives the
  hidden states and :func:`klpen.linear_logprobs` the log-probs and the entropy of
  ``softmax(hidden @ W.T / temperature)`` from them, in one pass, never building the logits.
  Padded completion slots are 0, as in TRL.
- The KL term of ``GRPOTrainer._compute_loss``: TRL writes ``exp(ref - logp) - (ref - logp) - 1``
  inline; here it is ``klpen.estimate_kl(logp, ref, "k3")`` (the same k3, computed without
  cancellation for small log-ratios). The loss around it is TRL's, line for line, for the
  configurations TRL calls standard: ``loss_type`` ``"grpo"``, ``"bnpo"``, ``"dr_grpo"`` or
  ``"dapo"``, token-level importance sampling, no vLLM, no entropy mask, bonus or off-policy
  mask, no two-sided ``delta``, no bias-corrected KL, no MoE auxiliary loss, text-only models
  without logit soft-capping or scaling. Any other configuration falls back to TRL's own code,
  unchanged.

Parity (``tests/test_trl_example.py``, 3 steps, same seed, a 2-layer Llama built from a config,
one thread): in fp32 TRL's logged ``loss``, ``kl`` and ``entropy`` and klpen's agree to 1e-6, the
test's bound; measured, the largest differences over the 3 steps were 0 on the loss, 5.6e-9 on
the KL (of 0.023) and 2.4e-7 on the entropy (of 2.4), fp32 rounding. Under bf16 autocast
(``--bf16``) both compute the log-probs in fp32 from bf16 hidden states and a bf16 head, but
round the bf16 matmul in different places (TRL's fused head tiles the tokens, klpen the
vocabulary), so the numbers differ by bf16's rounding of the logits: measured, at most 1.1e-5 on
the logged loss, 1.1e-4 on the logged KL (0.5 % of it) and 9.4e-5 on the entropy over the 3
steps. ``python examples/trl_grpo.py --compare [--bf16]`` prints these differences.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

import klpen

# --- klpen in TRL: the two terms ------------------------------------------------------------


class KLPenGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
    """TRL's ``GRPOTrainer`` with klpen's log-probs, entropy and k3 KL term."""

    def _klpen_handles_loss(self) -> bool:
        """Whether the configuration is one this class computes; else TRL's own code runs."""
        if self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            return False
        args = self.args
        return bool(
            self.importance_sampling_level == "token"
            and self.top_entropy_quantile == 1.0
            and self.off_policy_mask_threshold is None
            and not self.use_vllm
            and args.delta is None
            and not args.use_bias_correction_kl
            and not self._entropy_bonus_enabled
            and not self.aux_loss_enabled
        )

    def _get_per_token_logps_and_entropies(  # type: ignore[no-untyped-def]
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **extra,
    ):
        config = model.config.get_text_config()
        if (
            compute_aux_loss
            or any(value is not None for value in extra.values())
            or getattr(config, "final_logit_softcapping", None) is not None
            or getattr(config, "logit_scale", None) not in (None, 1.0)
        ):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **extra,
            )
        batch_size = batch_size or input_ids.size(0)
        head = model.get_output_embeddings()
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start : start + batch_size]
            keep = attention_mask[start : start + batch_size]
            with self.accelerator.autocast():
                hidden = model.base_model(input_ids=ids, attention_mask=keep, use_cache=False)
                # The hidden state before each completion token predicts it.
                hidden = hidden.last_hidden_state[:, -logits_to_keep - 1 : -1]
                logp, entropy = klpen.linear_logprobs(
                    hidden,
                    head.weight,
                    ids[:, -logits_to_keep:],
                    bias=head.bias,
                    temperature=self.temperature,
                    return_entropy=True,
                )
            valid = keep[:, -logits_to_keep:].bool()
            logps.append(logp.masked_fill(~valid, 0.0))
            entropies.append(entropy.masked_fill(~valid, 0.0))
        entropy_out = torch.cat(entropies) if compute_entropy else None
        return torch.cat(logps), entropy_out, None

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if not self._klpen_handles_loss():
            return super()._compute_loss(model, inputs)  # type: ignore[no-any-return]
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        logp, entropies, _ = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
        )
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = logp.detach() if old is None else old
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
        if self.beta != 0.0:
            per_token_kl = klpen.estimate_kl(logp, inputs["ref_per_token_logps"], "k3")
            per_token_loss = per_token_loss + self.beta * per_token_kl

        # TRL's aggregation for each loss_type, then its gradient-accumulation scaling.
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "grpo":
            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif self.loss_type == "bnpo":
            loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        elif self.loss_type == "dr_grpo":
            loss = (per_token_loss * mask).sum() / (mask.size(0) * self.max_completion_length)
        if self.loss_type == "dapo":
            items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                items = items * accumulation / self.args.steps_per_generation
            loss = (per_token_loss * mask).sum() / items
        else:
            loss = loss / accumulation

        # TRL's metrics, under TRL's names.
        def global_masked_mean(x: torch.Tensor) -> float:
            totals = torch.stack([(x * mask).sum(), mask.sum().float()])
            totals = self.accelerator.reduce(totals, reduction="sum")
            return float((totals[0] / totals[1].clamp(min=1.0)).item())

        def seq_mean(x: torch.Tensor) -> torch.Tensor:
            return self.accelerator.gather((x * mask).sum(-1) / mask.sum(-1))

        metrics = self._metrics[mode]
        if self.beta != 0.0:
            metrics["kl"].append(global_masked_mean(per_token_kl))
        metrics["entropy"].append(global_masked_mean(entropies))
        low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
        metrics["clip_ratio/low_mean"].append(global_masked_mean(low.float()))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(high.float()))
        metrics["clip_ratio/region_mean"].append(global_masked_mean((low | high).float()))
        metrics["clip_ratio/low_min"].append(nanmin(seq_mean(low.float())).item())
        metrics["clip_ratio/high_max"].append(nanmax(seq_mean(high.float())).item())
        return loss


# --- a tiny, local model and task -----------------------------------------------------------

WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a few letters, built in code (no download)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


def tiny_model(vocab_size: int, seed: int) -> LlamaForCausalLM:
    """A 2-layer Llama from a config, with random weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return LlamaForCausalLM(config)


def count_a(completions: list[str], **_: Any) -> list[float]:
    """The reward: how many ``a`` a completion holds."""
    return [float(text.split().count("a")) for text in completions]


class _Log(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        if logs and "loss" in logs:
            self.logs.append({k: float(v) for k, v in logs.items() if isinstance(v, int | float)})


def train(
    *,
    use_klpen: bool = True,
    bf16: bool = False,
    steps: int = 3,
    seed: int = 0,
    beta: float = 0.1,
    trainer_class: type | None = None,
) -> list[dict[str, float]]:
    """Run GRPO for ``steps`` steps and return TRL's log, one dict per step.

    ``trainer_class`` overrides the choice ``use_klpen`` makes (the test passes recording
    subclasses of either).
    """
    tokenizer = tiny_tokenizer()
    prompts = [" ".join(WORDS[i % 8 : i % 8 + 3]) for i in range(16)]
    with tempfile.TemporaryDirectory() as out:
        # TRL loads the reference model from the policy's path: save the tiny model there.
        model_dir = os.path.join(out, "model")
        tiny_model(len(tokenizer), seed).save_pretrained(model_dir)
        config = GRPOConfig(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=8,
            learning_rate=1e-2,
            beta=beta,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=bf16,
            seed=seed,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        if trainer_class is None:
            trainer_class = KLPenGRPOTrainer if use_klpen else GRPOTrainer
        log = _Log()
        trainer = trainer_class(
            model=model_dir,
            reward_funcs=count_a,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
            callbacks=[log],
        )
        trainer.train()
    return log.logs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--stock", action="store_true", help="TRL's own terms")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--compare", action="store_true", help="both, and their difference")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.compare:
        ours = train(use_klpen=True, bf16=args.bf16, steps=args.steps)
        theirs = train(use_klpen=False, bf16=args.bf16, steps=args.steps)
        for key in ("loss", "kl", "entropy"):
            diff = max(abs(a[key] - b[key]) for a, b in zip(ours, theirs, strict=True))
            print(json.dumps({"max_abs_difference": key, "value": diff}))
        return
    for row in train(use_klpen=not args.stock, bf16=args.bf16, steps=args.steps):
        print(json.dumps(row))


if __name__ == "__main__":
    main(sys.argv[1:])
