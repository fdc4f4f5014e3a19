"""Scaling laws: IsoFLOP sweeps on this machine, Chinchilla-style fits (Approaches 2 and 3) and compute-optimal
plans."""
from lmkit.scaling.fit import IsoFlopFit, LawFit, bootstrap_fit, fit_law, isoflop_fit
from lmkit.scaling.laws import BESIROGLU, CHINCHILLA, FLOPS_PER_TOKEN, PUBLISHED_EXPONENTS, ScalingLaw, law_from
from lmkit.scaling.plan import ComputePlan, plan_compute

__all__ = ["BESIROGLU", "CHINCHILLA", "ComputePlan", "FLOPS_PER_TOKEN", "IsoFlopFit", "LawFit", "PUBLISHED_EXPONENTS",
           "ScalingLaw", "bootstrap_fit", "fit_law", "isoflop_fit", "law_from", "plan_compute"]
