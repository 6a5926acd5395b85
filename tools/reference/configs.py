"""config.json builders for the tiny Step model (models/tiny-step) and the golden random model."""
import copy

from step_ref import quantization_config, StepConfig

FULL, SLIDING = "full_attention", "sliding_attention"

TINY_TEXT = {
    "model_type": "step3p5",
    "architectures": ["Step3p5ForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 5,
    "num_nextn_predict_layers": 3,
    "vocab_size": 4096,
    "max_seq_len": 4096,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
    "head_dim": 32,
    "num_attention_heads": 8,
    "num_attention_groups": 4,
    "attention_other_setting": {
        "attention_type": SLIDING,
        "num_attention_heads": 12,
        "num_attention_groups": 4,
        "head_dim": 32,
        "true_head_dim": 32,
    },
    "att_impl_type": "GQA",
    "layer_types": [FULL, SLIDING, SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING],
    "sliding_window": 64,
    "rope_theta": [500000.0, 10000.0, 10000.0, 10000.0, 500000.0, 10000.0, 10000.0, 10000.0],
    "partial_rotary_factors": [0.5, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0],
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 2.0,
        "original_max_position_embeddings": 128,
        "low_freq_factor": 1.0,
        "high_freq_factor": 32.0,
    },
    "yarn_only_types": [FULL],
    "use_qk_norm": True,
    "use_head_wise_attn_gate": True,
    "use_moe": True,
    "moe_layers_enum": "1,2,3,4",
    "moe_layer_offset": 0,
    "moe_every_n_layer": 1,
    "moe_num_experts": 16,
    "moe_top_k": 4,
    "moe_intermediate_size": 128,
    "share_expert_dim": 128,
    "norm_expert_weight": True,
    "moe_router_activation": "sigmoid",
    "moe_router_scaling_factor": 2.5,
    "use_moe_router_bias": True,
    "need_fp32_gate": True,
    "swiglu_limits": [0.0, 0.0, 0.0, 7.0, 7.0, 0.0, 0.0, 0.0],
    "swiglu_limits_shared": [0.0, 0.0, 0.0, 16.0, 16.0, 0.0, 0.0, 0.0],
    "bos_token_id": 0,
    "eos_token_id": [5, 2],
    "tie_word_embeddings": False,
    "zero_centered": True,
    "sink": False,
}


def wrap(text):
    """Step-3.7 nested layout (docs/MODEL.md §1.1) with the compressed-tensors block (§5.4)."""
    text = copy.deepcopy(text)
    return {
        "architectures": ["Step3p7ForConditionalGeneration"],
        "model_type": "step3p7",
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": text,
        "quantization_config": quantization_config(StepConfig(text)),
    }


def tiny_config(swiglu_limit=7.0, swiglu_limit_shared=16.0):
    t = copy.deepcopy(TINY_TEXT)
    t["swiglu_limits"] = [0.0, 0.0, 0.0, swiglu_limit, swiglu_limit, 0.0, 0.0, 0.0]
    t["swiglu_limits_shared"] = [0.0, 0.0, 0.0, swiglu_limit_shared, swiglu_limit_shared, 0.0, 0.0, 0.0]
    return wrap(t)


def random_golden_config():
    """Smaller random model that stresses edge cases: window 16 (sequences of 80+ tokens exceed it),
    llama3 original_max_position_embeddings 32 (smooth band active), clamps that bind (limits 1.0/2.0,
    also on the dense layer 0 and the MTP layers), 8 experts top-2."""
    t = copy.deepcopy(TINY_TEXT)
    t.update({
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 5,
        "num_nextn_predict_layers": 3,
        "vocab_size": 4096,
        "head_dim": 16,
        "num_attention_heads": 4,
        "num_attention_groups": 2,
        "attention_other_setting": {"attention_type": SLIDING, "num_attention_heads": 6,
                                    "num_attention_groups": 2, "head_dim": 16, "true_head_dim": 16},
        "sliding_window": 16,
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 32,
                         "low_freq_factor": 1.0, "high_freq_factor": 8.0},
        "moe_num_experts": 8,
        "moe_top_k": 2,
        "moe_intermediate_size": 64,
        "share_expert_dim": 32,
        "moe_router_scaling_factor": 3.0,
        "swiglu_limits": [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0],
        "swiglu_limits_shared": [2.0, 0.0, 0.0, 2.0, 2.0, 0.0, 1.5, 0.0],
    })
    return wrap(t)
