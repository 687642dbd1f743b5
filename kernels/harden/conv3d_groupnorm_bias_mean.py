"""Broken on purpose (the Sakana AI CUDA Engineer pattern, KernelBench PR #25): the "fused GroupNorm +
mean" writes the mean of the GroupNorm bias into every output.  The mean over a group of normalised
values is 0, so with a per-group constant weight the true output is mean(bias) up to rounding: exact at
default init (weight 1, bias 0), wrong as soon as the GroupNorm weight varies within a group."""
import torch
import torch.nn as nn

DIFFKIT_EXPECT = {"reference": "hk_conv3d_groupnorm_mean.py", "harden": "init", "stage": "output"}


class ModelNew(nn.Module):
    def __init__(self, cin, cout, k, groups):
        super().__init__()
        self.vol = nn.Conv3d(cin, cout, k)
        self.grp = nn.GroupNorm(groups, cout)

    def forward(self, vid):
        feat = self.vol(vid)
        # "GroupNorm followed by the full mean reduces to the bias mean": one value per sample
        return self.grp.bias.mean().expand(feat.shape[0]).contiguous()
