"""RLHF with a KL penalty on a tiny GPT-2, end to end, in under a minute on a laptop CPU.

The loop of chapter 9 of the klpen book, outside the book, as a starting point for your own
trainer: replace the toy pieces (the grammar, ``proxy_reward``, ``tiny_gpt2``) by your
tokenizer, reward model and checkpoint, and keep the loop.

    python examples/tiny_rlhf.py                   # k1 in the reward, β = 0.5
    python examples/tiny_rlhf.py --target-kl 2     # adaptive β (Ziegler) aiming at 2 nats
    python examples/tiny_rlhf.py --kl-coef 0       # no penalty: watch the reward hacking

What it does, per update: sample responses with ``model.generate``; mask each response after
its first EOS; compute the per-token log-probs of the policy and the frozen reference with
``next_token_logprobs``; put ``-β·k1`` at every token and the reward-model score at the last
(``shape_rewards``); take one policy-gradient step on the whitened rewards-to-go; feed the
sampled KL to the controller. It logs the proxy reward, the share of outputs that are
sentences of the grammar (the true reward, known here), and the exact KL to the reference
(``full_kl`` summed over the response) next to its sampled estimate. The last line it prints
is a JSON summary.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from klpen import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    aggregate,
    estimate_kl,
    full_kl,
    masked_mean,
    masked_sum,
    next_token_logprobs,
    response_mask,
    shape_rewards,
)
from klpen_book import language as lm
from klpen_book.bandit import single_threaded


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kl-coef", type=float, default=0.5, help="(initial) β; 0: no penalty")
    parser.add_argument("--target-kl", type=float, default=None, help="adaptive β: nats/sequence")
    parser.add_argument("--horizon", type=float, default=128.0, help="Ziegler's horizon")
    parser.add_argument("--steps", type=int, default=30, help="RLHF updates")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sft-steps", type=int, default=100, help="reference training steps")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()

    # The reference ("SFT") model. With a real checkpoint:
    #   reference = AutoModelForCausalLM.from_pretrained(name); policy = copy of it.
    reference = lm.tiny_gpt2(seed=args.seed)
    lm.train_reference(reference, lm.sample_sentences(4096, seed=args.seed), steps=args.sft_steps)
    reference.eval().requires_grad_(False)
    policy = copy.deepcopy(reference).train().requires_grad_(True)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    controller: KLController | None = None
    if args.kl_coef > 0 and args.target_kl is not None:
        controller = AdaptiveKLController(args.kl_coef, args.target_kl, args.horizon)
    elif args.kl_coef > 0:
        controller = FixedKLController(args.kl_coef)

    prompts = lm.prompts(args.batch_size)  # (B, P): "<bos> the", "<bos> a", ...
    n_prompt = prompts.shape[1]
    for step in range(args.steps):
        kl_coef = controller.kl_coef if controller is not None else 0.0

        # 1. Rollout.
        torch.manual_seed(args.seed * 1000 + step)
        with torch.no_grad():
            sequences = policy.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=10,
            )
        responses = sequences[:, n_prompt:]
        mask = response_mask(responses, lm.EOS_ID)
        attention_mask = torch.cat([torch.ones_like(prompts), mask.long()], dim=1)

        # 2. Log-probs of the response tokens under the policy and the reference.
        logits = policy(sequences, attention_mask=attention_mask).logits
        with torch.no_grad():
            ref_logits = reference(sequences, attention_mask=attention_mask).logits
        logprobs = next_token_logprobs(logits, sequences)[:, n_prompt - 1 :]
        ref_logprobs = next_token_logprobs(ref_logits, sequences)[:, n_prompt - 1 :]

        # 3. Score, KL, per-token rewards.
        scores = lm.proxy_reward(responses, mask)
        k1 = estimate_kl(logprobs.detach(), ref_logprobs, "k1")
        rewards = shape_rewards(scores, k1, mask=mask, kl_coef=kl_coef)

        # 4. Advantages: rewards-to-go, whitened over the batch's tokens. Policy-gradient loss.
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
        mean = masked_mean(returns, mask)
        advantages = (returns - mean) / (masked_mean((returns - mean) ** 2, mask).sqrt() + 1e-8)
        loss = aggregate(-advantages * logprobs, mask, "seq-mean-token-mean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        # 5. Control β with the sampled KL; log the exact KL next to it.
        sampled_kl = float(masked_sum(k1, mask, dim=-1).mean())
        if controller is not None:
            controller.update(sampled_kl, n_steps=args.batch_size)
        exact = full_kl(logits.detach()[:, n_prompt - 1 : -1], ref_logits[:, n_prompt - 1 : -1])
        exact_kl = float(masked_sum(exact, mask, dim=-1).mean())
        well_formed = float(lm.well_formed(sequences).double().mean())
        print(
            f"step {step:3d}  β {kl_coef:.3f}  proxy reward {float(scores.mean()):5.2f}  "
            f"well-formed {well_formed:.2f}  KL exact {exact_kl:6.2f}  sampled {sampled_kl:6.2f}"
        )

    print("samples:")
    for row in sequences[:4]:
        print("   ", lm.decode(row))
    summary = {
        "proxy_reward": float(scores.mean()),
        "well_formed": well_formed,
        "exact_kl": exact_kl,
        "sampled_kl": sampled_kl,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    with single_threaded():  # tiny tensors: one thread is fastest and reproducible
        main()
