"""Greedy output equals Hugging Face transformers' greedy output, token for token, in float32.

The reference is transformers loading the same GGUF file on its own (its own dequantization and
q/k un-permutation), so a mistake in our converter shows up here too.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import PROMPTS, assert_no_leaks

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    from services.engine.model.source import default_model_path

    path = default_model_path()
    kwargs = {"gguf_file": path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=torch.float32, **kwargs
    ).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    tokenizer, model = hf_model
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        outputs.append((ids[0].tolist(), generated[0, ids.shape[1] :].tolist()))
    return outputs


def greedy():  # type: ignore[no-untyped-def]
    from pdserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


def test_tokenizer_matches_transformers(llm, hf_reference):
    for prompt, (hf_ids, _) in zip(PROMPTS, hf_reference):
        assert llm.get_tokenizer().encode(prompt) == hf_ids


def test_greedy_one_at_a_time_matches_transformers(engine_llm, hf_reference):
    for prompt, (_, hf_tokens) in zip(PROMPTS, hf_reference):
        [out] = engine_llm.generate(prompt, greedy())
        assert out.outputs[0].token_ids == hf_tokens, prompt


def test_greedy_batched_matches_transformers(engine_llm, hf_reference):
    outs = engine_llm.generate(PROMPTS, greedy())
    for out, (_, hf_tokens) in zip(outs, hf_reference):
        assert out.outputs[0].token_ids == hf_tokens, out.prompt
    assert_no_leaks(engine_llm.engine)


def test_converted_weights_equal_transformers_gguf_weights(llm, hf_model):
    """Our converter and transformers' GGUF loader agree on every weight."""
    from services.engine.model.loader import load_weights

    theirs = hf_model[1].state_dict()
    for name, tensor in load_weights(llm.engine.model_dir).items():
        assert torch.equal(tensor, theirs[name]), name
