"""A transformers model with larger random weights, and the lmkit model loaded from the folder it saved."""
import torch

import lmkit


VOCAB = 101  # not a multiple of 8


def randomized(m):
    with torch.no_grad():  # larger weights than the default init, so mismatches show
        for n, p in m.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            elif "bias" in n:
                p.normal_(0, 0.05)
            else:
                p.normal_(1.0, 0.1)
    return m.eval()


def saved_pair(hf, name: str, tmp_path_factory):
    """(transformers model, lmkit model loaded from the folder transformers wrote, folder)."""
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return hf, lmkit.load_model(folder), folder
