"""lmkit.nn.plain: the one rule for whether a fused path may stand in for a module's forward."""
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from lmkit.config import ModelConfig
from lmkit.models import CausalLM
from lmkit.nn import Attention, Block, FeedForward
from lmkit.nn.plain import hooked, plain, unhooked
from lmkit.peft.lora import LoRALinear

CONFIG = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_seq_len=16)


class Renamed(nn.Linear):
    """A subclass that keeps nn.Linear's forward: the fused paths compute what it computes."""


class Doubled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_module_is_plain_when_it_runs_its_kinds_forward_on_its_own_weights_unwatched():
    assert plain(nn.Linear(3, 4), nn.Linear)
    assert plain(Renamed(3, 4), nn.Linear)
    assert not plain(Doubled(3, 4), nn.Linear)  # its own forward: bypassing it would drop the doubling
    assert not plain(LoRALinear(nn.Linear(3, 4), r=2), nn.Linear)  # an adapter is another class
    assert not plain(None, nn.Linear)
    assert not plain(nn.Linear(3, 4), (Attention, FeedForward))
    assert plain(FeedForward(CONFIG), (Attention, FeedForward))
    watched = nn.Linear(3, 4)
    handle = watched.register_forward_hook(lambda m, i, o: o * 0)
    assert hooked(watched) and not plain(watched, nn.Linear)
    handle.remove()
    assert plain(watched, nn.Linear)
    before = nn.Linear(3, 4)
    before.register_forward_pre_hook(lambda m, i: None)
    assert not plain(before, nn.Linear)
    # a parametrized weight is computed at each forward, not the tensor a fused path would read
    assert not plain(weight_norm(nn.Linear(3, 4)), nn.Linear)


def test_deep_looks_at_every_module_inside():
    block = Block(CONFIG, causal=True)
    assert plain(block, Block, deep=True)
    block.mlp.sublayer.down_proj.register_forward_hook(lambda m, i, o: None)
    assert plain(block, Block) and not plain(block, Block, deep=True) and not unhooked(block)


def test_the_model_callers_follow_the_rule():
    """CausalLM's decode plan and the Stack's pruning of the last block give way to hooks and adapters."""
    torch.manual_seed(0)
    model = CausalLM(CONFIG).eval()
    assert model.decode_plan(1) is not None
    assert model.decoder._prunes(torch.tensor([3]))
    attn = model.decoder.layers[1].self_attn.sublayer
    attn.q_proj = LoRALinear(attn.q_proj, r=2)
    assert model.decode_plan(1) is None and not attn.plain_projections() and attn.fused_qkv() is None
    assert model.decoder._prunes(torch.tensor([3]))  # pruning positions needs a plain Attention, not plain projections
    handle = model.decoder.layers[1].mlp.register_forward_pre_hook(lambda m, i: None)
    assert not model.decoder._prunes(torch.tensor([3]))
    handle.remove()

    class Scaled(CausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    assert Scaled(CONFIG).eval().decode_plan(1) is None  # a subclass's own forward decodes as written
