"""The strict primitives' constants: exp, log, rsqrt, SiLU.

Every primitive is built only from correctly rounded IEEE-754 operations (+, -, *, /, fma,
sqrt, max, integer bit operations), so the same formula gives the same bits on every SIMD
width, scalar tail, thread count and device. The C++ kernels carry a copy of these numbers
for their inner loops and assert at load that it equals this one.
"""
import math

LOG2E = 1.4426950408889634
# Cody-Waite split of ln 2: LN2_HI has trailing zero bits so n * LN2_HI is exact.
LN2_HI = 0.693145751953125
LN2_LO = 1.428606765330187e-06
# Taylor coefficients of exp on [-ln2/2, ln2/2]; degree 7 keeps the truncation error below
# float32 resolution (|r|^8/8! < 2e-8).
EXP_C = (1.0, 1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720, 1 / 5040)
EXP_MIN = -87.33  # below: exp flushes to exactly 0 (no subnormals)
EXP_MAX = 88.72
SQRT_HALF = math.sqrt(0.5)

EXP = ("exp", "float32: clamp, n = round(x*log2e), Cody-Waite reduction, degree-7 Horner, two 2^k factors")
LOG = ("log", "float32: exponent split, m in [sqrt(1/2), sqrt(2)), 2*atanh series to s^11")
RSQRT = ("rsqrt", "1/sqrt(x): IEEE division of 1 by the IEEE float32 sqrt (float64 sqrt rounded once)")
SILU = ("silu", "x / (1 + exp(-x)), float32")
FMA = ("fma", "fmaf: a*b + c rounded once (hardware fma, libm fma, or exact float64 round-to-odd emulation)")
