"""DeepSpeed's Ulysses for Hugging Face models (``UlyssesSPAttentionHF``,
``deepspeed/runtime/sequence_parallel/ulysses_sp.py``, DeepSpeed 0.19.8: what
``register_with_transformers`` installs as a model's attention, and what Accelerate's
DeepSpeed sequence parallelism runs), around transformers' own ``sdpa_attention_forward``,
for ``memcalc trace --cp P --cp-method ulysses``:

    memcalc trace examples/attention/ulysses_hf.py:attn --input q=B,H,N,D \\
        --input k=B,K,N,D --input v=B,K,N,D --cp 4 --cp-method ulysses \\
        --seq 131072 --heads 32 --head-dim 128 --dtype bf16 --batch 1

Each rank holds its N / P rows of q, k, v as the model's attention gets them, (B, H, N / P,
D); DeepSpeed lays them out sequence first, all-to-alls them (its ``dim_zero_all_to_all``
op) to every row of H / P heads, (B, H / P, N, D) contiguous for SDPA (the backend torch
picks), and gives the output back as (B, N / P, H x D). Not ``DistributedAttention``: its
copies differ, and ``memcalc breakdown --cp-method ulysses`` models that one only; the
trace runs this one as it is (``pip install 'memcalc[deepspeed,hf]'``).
"""

import torch
import torch.distributed as dist
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from transformers.integrations.sdpa_attention import sdpa_attention_forward


class Attention(torch.nn.Module):
    """What a Hugging Face attention module hands its attention function: causal, and its
    query heads per key/value head."""

    def __init__(self, groups: int):
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = groups


def attn(q, k, v):
    """One rank's step on its rows of q, k, v, (B, H, N / P, D); the positions are this
    rank's, as DeepSpeed's data loader shards them."""
    B, H, n, D = q.shape
    P, rank = dist.get_world_size(), dist.get_rank()
    layer = UlyssesSPAttentionHF(sdpa_attention_forward, batch_size=B, attn_head_count=H,
                                 attn_head_size=D, kv_head_count=k.shape[1],
                                 num_hidden_layers=1, process_group=dist.group.WORLD,
                                 local_seq_length=n, global_seq_length=n * P)
    positions = torch.arange(rank * n, (rank + 1) * n, device=q.device).expand(B, n)
    out, _ = layer(Attention(H // k.shape[1]), q, k, v, None, position_ids=positions)
    return out  # (B, N / P, H x D)
