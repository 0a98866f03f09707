"""The reference GPT built from `equishard.nn`, and what the command line reads of it: its
training under a layout (`gpt_training`), its train step lowered from shapes alone and
its report (`gpt_report`: the analytical minimum `gpt_minimum`, the memory estimate
`gpt_memory`, the model FLOPs `gpt_flops_per_token`).
"""

from ..nn import LoRA as LoRA  # its home is `equishard.nn`
from ..sharding import Parallelism as Parallelism  # its home is `equishard.sharding`
from ._flops import (
    gpt_flops_per_token as gpt_flops_per_token,
    gpt_matmul_parameters as gpt_matmul_parameters,
)
from ._generate import (
    Generation as Generation,
    Generator as Generator,
    Sampling as Sampling,
    generate as generate,
    sample_token as sample_token,
)
from ._gpt import (
    GPT as GPT,
    PRESETS as PRESETS,
    GPTConfig as GPTConfig,
    cast_floating as cast_floating,
    check_context_split as check_context_split,
    count_parameters as count_parameters,
    token_batch as token_batch,
)
from ._hf import (
    ARCHITECTURES as ARCHITECTURES,
    TOKENIZER_FILES as TOKENIZER_FILES,
    copy_tokenizer as copy_tokenizer,
    export_hf as export_hf,
    gpt_config_from_hf as gpt_config_from_hf,
    hf_mapping as hf_mapping,
    llama_config as llama_config,
    load_hf as load_hf,
    read_hf_config as read_hf_config,
)
from ._lora import (
    adapters_trainable as adapters_trainable,
    add_lora as add_lora,
    export_peft as export_peft,
    load_peft as load_peft,
    lora_of as lora_of,
    lora_trainable as lora_trainable,
    merge_lora as merge_lora,
    peft_mapping as peft_mapping,
    read_peft_config as read_peft_config,
)
from ._memory import gpt_memory as gpt_memory
from ._minimum import gpt_minimum as gpt_minimum, gpt_param_rows as gpt_param_rows
from ._report import gpt_report as gpt_report
from ._training import (
    AbstractStep as AbstractStep,
    GPTTraining as GPTTraining,
    abstract_train_step as abstract_train_step,
    check_gpt_layout as check_gpt_layout,
    gpt_training as gpt_training,
    precision_policy as precision_policy,
    preset as preset,
)
