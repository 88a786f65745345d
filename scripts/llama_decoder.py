"""The Llama-style decoder that scripts/record-trace.py records (llama_train_accum,
llama_generate) and bench/torch_bench.py times (--llama), in one place, so that the benchmark
runs what the bundled traces hold: 8 layers, hidden 1024, grouped-query attention with 4
key-value heads, vocabulary 32000, random weights."""

# greedy generation of 64 new tokens, as both record it
GENERATE_KWARGS = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)


def config(transformers):
    return transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                    num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                    max_position_embeddings=2048)


def prompt(torch, draws):
    """One generation call's prompt: a batch drawn from 1 to 16 prompts and a length from 32 to
    512 (from draws, a seeded torch.Generator), the tokens from the CUDA generator."""
    b = int(torch.randint(1, 17, (1,), generator=draws))
    n = int(torch.randint(32, 513, (1,), generator=draws))
    return torch.randint(1, 32000, (b, n), device="cuda")


def train_step(torch, model, opt):
    """One training step under bf16 autocast: gradients accumulated over 4 micro-batches of
    4 x 1024 tokens, then the optimizer's step."""
    for _ in range(4):
        ids = torch.randint(0, 32000, (4, 1024), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss / 4
        loss.backward()
        del loss, ids
    opt.step()
    opt.zero_grad(set_to_none=True)
