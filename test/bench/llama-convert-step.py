#!/usr/bin/env python3
"""llama-convert-step.py - llama.cpp's convert_hf_to_gguf.py for stepd's Step-3.7 checkpoints.

  LLAMA_CPP_DIR=SRC python llama-convert-step.py MODEL_DIR --outtype bf16 --outfile OUT.gguf

Runs the converter of the llama.cpp source tree SRC unchanged (its main(), every argument
passed on), with its Step-3.5/3.7 text model class (Step35Model) extended by the two things
llama.cpp 0.3.36 lacks for the checkpoints stepd loads (docs/PERFORMANCE.md §10):

- routed experts in compressed-tensors MXFP4 ("mixed-precision", per expert
  model.layers.L.moe.experts.E.{gate,up,down}_proj.weight_packed + .weight_scale): the class
  only knows the BF16 release's stacked tensors and raises on the quantization config.  Here
  each projection's experts are stacked into one ggml MXFP4 tensor by the converter's own
  lossless repack (ModelBase._mxfp4_expert_tensor: the same E8M0 scales and E2M1 codes, the
  nibbles moved), lazily, one tensor resident at a time;
- a tokenizer whose pre-tokenizer hash the converter's table does not know (stepd's tiny
  tokenizer): its splitting rules are DeepSeek-V3's, so "deepseek-v3" is written, with a
  note on stderr.  A known hash keeps the converter's answer.

Used by test/bench/llama-server-setup; needs the converter's Python requirements (torch).
Nothing here is llama.cpp's code: it is imported from SRC at run time."""
import os
import re
import sys

SRC = os.environ.get("LLAMA_CPP_DIR")
if not SRC or not os.path.isfile(os.path.join(SRC, "convert_hf_to_gguf.py")):
    sys.exit("llama-convert-step.py: LLAMA_CPP_DIR must name a llama.cpp source tree "
             "(with convert_hf_to_gguf.py)")
sys.path[:0] = [SRC, os.path.join(SRC, "gguf-py")]

import gguf  # noqa: E402
import convert_hf_to_gguf  # noqa: E402
from conversion.base import ModelBase  # noqa: E402
from conversion.step3 import Step35Model  # noqa: E402

EXPERT = re.compile(r"^model\.layers\.(\d+)\.moe\.experts\.(\d+)\.(gate|up|down)_proj\.weight_packed$")
PROJ = {"gate": gguf.MODEL_TENSOR.FFN_GATE_EXP, "up": gguf.MODEL_TENSOR.FFN_UP_EXP,
        "down": gguf.MODEL_TENSOR.FFN_DOWN_EXP}


class StepdStep35(Step35Model):
    model_arch = gguf.MODEL_ARCH.STEP35

    def _mxfp4_experts(self):
        """whether the checkpoint's quantized groups are all compressed-tensors MXFP4"""
        q = self.hparams.get("quantization_config") or \
            self.global_config.get("quantization_config") or {}
        groups = (q.get("config_groups") or {}).values()
        return q.get("quant_method") == "compressed-tensors" and bool(groups) and \
            all(g.get("format") == "mxfp4-pack-quantized" for g in groups)

    def dequant_model(self):
        if not self._mxfp4_experts():
            return super().dequant_model()
        other = [n for n in self.model_tensors if n.endswith(".weight_packed") and not EXPERT.match(n)]
        if other:
            raise ValueError("MXFP4 tensors other than routed experts: %s" % ", ".join(other[:3]))

    def get_vocab_base_pre(self, tokenizer):
        try:
            return super().get_vocab_base_pre(tokenizer)
        except NotImplementedError:
            print("llama-convert-step.py: unknown pre-tokenizer hash: writing deepseek-v3 "
                  "(the tiny tokenizer's rules)", file=sys.stderr)
            return "deepseek-v3"

    def generate_extra_tensors(self):
        if self._mxfp4_experts():
            n = self.hparams["moe_num_experts"]
            stacks = {}
            for name in self.model_tensors:
                m = EXPERT.match(name)
                if m:
                    stacks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = name
            done = []
            for (layer, proj), experts in sorted(stacks.items()):
                if sorted(experts) != list(range(n)):
                    raise ValueError("layer %d %s_proj: %d of %d experts" %
                                     (layer, proj, len(experts), n))
                pairs = []
                for e in range(n):
                    packed = experts[e]
                    scale = packed[:-len("_packed")] + "_scale"
                    pairs.append((self.model_tensors[packed], self.model_tensors[scale]))
                    done += [packed, scale]
                self.gguf_writer.add_tensor(self.format_tensor_name(PROJ[proj], layer),
                                            self._mxfp4_expert_tensor(pairs),
                                            raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            for name in done:
                del self.model_tensors[name]
        return list(super().generate_extra_tensors())


ModelBase.register("Step3p7ForConditionalGeneration", "Step3p5ForCausalLM")(StepdStep35)
convert_hf_to_gguf.main()
