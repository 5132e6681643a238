"""Multiple-choice accuracy through the gateway next to transformers on the same weights, the
way lm-evaluation-harness's ``local-completions`` backend scores a question: each choice's
log-likelihood is the sum of its tokens' logprobs after the question, read from an ``echo:
true, logprobs: 1, max_tokens: 0`` completion; the answer is the most likely choice.

    python -m benchmarks.mc_logprobs --url http://127.0.0.1:8000   # a running `pdserve up`

Prints both accuracies and the largest difference between the two log-likelihoods of a choice
(docs/api.md, "Checking a served model's accuracy").
"""

from __future__ import annotations

import argparse

import httpx
import torch

QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"], 0),
    ("Water freezes at a temperature of", [" 100 degrees", " 0 degrees", " 50 degrees"], 1),
    ("The opposite of hot is", [" cold", " loud", " tall"], 0),
    ("A week has", [" five days", " seven days", " ten days"], 1),
    ("The sun rises in the", [" west", " north", " east"], 2),
    ("Two plus two equals", [" four", " five", " three"], 0),
    ("Cats are animals that say", [" moo", " woof", " meow"], 2),
    ("The color of the clear sky is", [" green", " blue", " red"], 1),
    ("Bees make", [" honey", " milk", " silk"], 0),
    ("The largest planet in our solar system is", [" Mars", " Jupiter", " Venus"], 1),
]


def split(tokenizer, context: str, choice: str) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    """lm-eval's split: the whole text's tokens, the context's first."""
    whole = tokenizer(context + choice).input_ids
    num_context = len(tokenizer(context).input_ids)
    return whole[:num_context], whole[num_context:]


def gateway_loglik(client: httpx.Client, model: str, ctx: list[int], cont: list[int]) -> float:
    body = {"model": model, "prompt": ctx + cont, "echo": True, "logprobs": 1, "max_tokens": 0}
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    token_logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    return float(sum(token_logprobs[len(ctx) :]))


def hf_loglik(model, ctx: list[int], cont: list[int]) -> float:  # type: ignore[no-untyped-def]
    ids = torch.tensor([ctx + cont])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return float(sum(logprobs[len(ctx) + i - 1, t].item() for i, t in enumerate(cont)))


def main() -> None:
    import transformers

    from services.engine.config import EngineConfig
    from services.engine.model.source import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    config = EngineConfig()
    path = str(resolve_model_dir(config.model, config.cache_path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    right = {"gateway": 0, "transformers": 0}
    worst = 0.0
    with httpx.Client(base_url=args.url, timeout=60) as client:
        for context, choices, answer in QUESTIONS:
            scores: dict[str, list[float]] = {"gateway": [], "transformers": []}
            for choice in choices:
                ctx, cont = split(tokenizer, context, choice)
                scores["gateway"].append(gateway_loglik(client, args.model, ctx, cont))
                scores["transformers"].append(hf_loglik(model, ctx, cont))
            for name, values in scores.items():
                right[name] += int(max(range(len(values)), key=values.__getitem__) == answer)
            pairs = zip(scores["gateway"], scores["transformers"])
            worst = max([worst, *(abs(a - b) for a, b in pairs)])
    total = len(QUESTIONS)
    for name, count in right.items():
        print(f"{name:>12}: accuracy {count}/{total} = {count / total:.2f}")
    print(f"largest log-likelihood difference: {worst:.2e}")


if __name__ == "__main__":
    main()
