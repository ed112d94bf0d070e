"""Real SmolLM2 weights: the built fp32 packages (run by onnxruntime) against transformers on the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxgen.genai.package import load_package_config
from onnxgen.models import fetch
from tests.test_models_source import _hf_state_dict

PROMPT_IDS = [1, 504, 3458, 282, 4649, 314, 1761, 30, 378, 3458, 282, 8066, 314]  # arbitrary real token ids
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(smollm2_packages):
    import transformers

    gguf = fetch.cached_gguf("smollm2-135m-instruct")
    assert gguf is not None, "the package fixture pulls the GGUF first"
    config, tensors = _hf_state_dict(gguf, keep=True)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model


def ort_greedy(package, ids: list[int], new: int) -> tuple[np.ndarray, list[int]]:
    """Prefill logits and greedy tokens from onnxruntime on the raw graph (growing KV)."""
    import onnxruntime as ort

    config = load_package_config(package)
    session = ort.InferenceSession(str(config.model_file), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    past = {}
    for layer in range(config.num_layers):
        for key in (config.past_key_name(layer), config.past_value_name(layer)):
            past[key] = np.zeros((1, config.num_kv_heads, 0, config.head_size), np.float32)
    tokens, first_logits, seq, length = [], None, list(ids), 0
    for _ in range(new):
        feeds = {"input_ids": np.array([seq]), "attention_mask": np.ones((1, length + len(seq)), np.int64), **past}
        if "position_ids" in names:
            feeds["position_ids"] = np.arange(length, length + len(seq))[None]
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        if first_logits is None:
            first_logits = outputs["logits"][0]
        for layer in range(config.num_layers):
            past[config.past_key_name(layer)] = outputs[config.present_key_name(layer)]
            past[config.past_value_name(layer)] = outputs[config.present_value_name(layer)]
        length += len(seq)
        seq = [int(outputs["logits"][0, -1].argmax())]
        tokens.append(seq[0])
    return first_logits, tokens


@pytest.mark.parametrize("flavour", ["fp32-gqa", "fp32-standard"])
def test_package_logits_and_greedy_match_transformers(smollm2_packages, hf_model, flavour):
    logits, tokens = ort_greedy(smollm2_packages[flavour], PROMPT_IDS, NEW_TOKENS)
    with torch.inference_mode():
        reference = hf_model(torch.tensor([PROMPT_IDS])).logits[0].numpy()
        generated = hf_model.generate(
            torch.tensor([PROMPT_IDS]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )[0, len(PROMPT_IDS) :].tolist()
    scale = np.abs(reference).max()
    assert np.abs(logits - reference).max() < 1e-4 * scale, "prefill logits differ from transformers"
    assert tokens == generated, "greedy tokens differ from transformers"
