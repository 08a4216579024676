"""Probe (sm_90 code only, no GPU; then removed): MXFP4 weights stored as each thread's
wgmma fragments. For a 16-row group g and a 64-column chunk q of W, 512 bytes in the
order [rr 8][c 4][t 4][bh 2][bl 2]: lane (rr, c) reads its 16 bytes in one load, 4
e2m1 words, word t holding the 8 values of its A fragment for k tile t (rows 16g + rr
and 16g + rr + 8, k = 64q + 16t + {2c, 2c + 1, 2c + 8, 2c + 9}) in the slots the
e2m1-word PTX decode fills ($0..$3 = a0a1, a2a3, a4a5, a6a7; a load-time relabelling of
WORD_BITS); the scales as [rr 8][bh 2][kb 2] per (g, q). The kernel (a dense product
out^T = W x^T, W on wgmma's M side from registers) decodes, joins the two outputs and
permutes them into [rows, k]: Triton's layouts then meet the fragment with no shuffle.
Prints the K loop's instructions by kind for a few tiles (BG row groups, BT tokens, QS
chunks a step). Answer: benchmarks/LOG.md, "MXFP4 as each thread's MMA fragments".

    PATH=$B:$PATH TRITON_PTXAS_PATH=$B/ptxas-blackwell python benchmarks/mxfp4_fragment_probe.py BG BT WARPS STAGES QS
    (B: the nvidia backend's bin folder in Triton's wheel)
"""
import os, sys, re, subprocess
os.makedirs("/tmp/swap", exist_ok=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT + "/src"); sys.path.insert(0, ROOT + "/tests")
import triton, triton.language as tl
from loraplex.ops.triton.quant_tiles import _E2M1_WORD_ASM
from sm90_codegen import compile_sm90, const

@triton.jit
def frag_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, R, KH, stride_xm, stride_wg, stride_sr, stride_om,
                BG: tl.constexpr, BT: tl.constexpr, NQ: tl.constexpr, QS: tl.constexpr):
    # W swizzled: for row group g (16 rows) and k64 chunk q, 512 bytes: [rr 8][c 4][t 4][bh 2][bl 2]
    pid_r = tl.program_id(0)
    pid_t = tl.program_id(1)
    g = pid_r * BG + tl.arange(0, BG)
    toks = pid_t * BT + tl.arange(0, BT)
    rr = tl.arange(0, 8); t4 = tl.arange(0, 4); bh = tl.arange(0, 2)
    rows_s = (16 * g[:, None, None, None] + 8 * bh[None, None, None, :] + rr[None, :, None, None])  # [BG, 8, 4(t), 2]
    acc = tl.zeros((16 * BG, BT), dtype=tl.float32)
    for q0 in range(0, NQ, QS):
        qq = tl.arange(0, QS)
        data = tl.load(w_ptr + g[:, None, None] * stride_wg + (q0 + qq)[None, :, None] * 512 + tl.arange(0, 512)[None, None, :])
        data = tl.reshape(data, (BG, QS, 8, 4, 4, 2, 2))  # g, q, rr, c, t, bh, bl
        # scales swizzled: per (g, q) 32 bytes [rr 8][bh 2][kb 2]; every c of a row reads the same word
        cc = tl.arange(0, 4); bb = tl.arange(0, 2)
        sp = (s_ptr + g[:, None, None, None, None, None] * stride_sr + (q0 + qq)[None, :, None, None, None, None] * 32
              + rr[None, None, :, None, None, None] * 4 + 0 * cc[None, None, None, :, None, None]
              + bb[None, None, None, None, :, None] * 2 + bb[None, None, None, None, None, :])
        sc = tl.load(sp)  # [BG, QS, 8, 4(c), 2(bh), 2(kb)]
        mult = ((sc.to(tl.int32) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        mult = tl.permute(mult, (0, 1, 2, 3, 5, 4))  # .., kb, bh
        mult = tl.broadcast_to(mult[:, :, :, :, :, None, :], (BG, QS, 8, 4, 2, 2, 2))  # .., kb, t2, bh
        mult = tl.reshape(mult, (BG, QS, 8, 4, 4, 2))
        mult = tl.broadcast_to(mult[:, :, :, :, :, :, None], (BG, QS, 8, 4, 4, 2, 2))
        lo, hi = tl.inline_asm_elementwise(_E2M1_WORD_ASM, "=r,=r,=r,=r,r,r,r", [data, mult],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        w = tl.join(lo, hi)  # g, q, rr, c, t, bh, bl, h
        w = tl.permute(w, (0, 5, 2, 1, 4, 7, 3, 6))  # g, bh, rr, q, t, h, c, bl
        w = tl.reshape(w, (16 * BG, 64 * QS))
        k = q0 * 64 + tl.arange(0, 64 * QS)
        x = tl.load(x_ptr + toks[:, None] * stride_xm + k[None, :])
        acc = tl.dot(w, tl.trans(x), acc)
    r = pid_r * 16 * BG + tl.arange(0, 16 * BG)
    tl.store(out_ptr + toks[None, :] * stride_om + r[:, None], acc.to(tl.bfloat16))

BG, BT, nw, ns, QS = (int(a) for a in sys.argv[1:6])
args = dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", out_ptr="*bf16", T=16, R=5760, KH=1440,
            stride_xm=2880, stride_wg=16 * 1440, stride_sr=45*32, stride_om=5760,
            BG=const(BG), BT=const(BT), NQ=const(44), QS=const(QS))
k = compile_sm90(frag_kernel, args, nw, ns)
open("/tmp/swap/f.cubin", "wb").write(k.asm["cubin"])
open("/tmp/swap/f.ttgir", "w").write(k.asm["ttgir"])
B = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
res = subprocess.run([f"{B}/cuobjdump", "--dump-resource-usage", "/tmp/swap/f.cubin"], capture_output=True, text=True).stdout
sass = subprocess.run([f"{B}/nvdisasm", "-c", "/tmp/swap/f.cubin"], capture_output=True, text=True).stdout
open("/tmp/swap/f.sass", "w").write(sass)
print("BG", BG, "BT", BT, re.findall(r"REG:\d+|STACK:\d+", res), "shared", k.metadata.shared,
      "HGMMA", sass.count("HGMMA"), "HMMA", sass.count("HMMA"), "convert_layout", k.asm["ttgir"].count("convert_layout"),
      "local_alloc", k.asm["ttgir"].count("local_alloc"))


# The K loop's instructions (the longest backward branch):

# The K loop's instructions by kind (the longest backward branch of the SASS).
import re, sys
for f in ["/tmp/swap/f.sass"]:
    lines = open(f).read().splitlines()
    labels = {l.strip().rstrip(':'): i for i, l in enumerate(lines) if re.match(r'^\.L_x_\d+:', l.strip())}
    best = None
    for i, l in enumerate(lines):
        m = re.search(r'BRA\s+`?\(?(\.L_x_\d+)', l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            n = sum(1 for x in lines[labels[m.group(1)]:i+1] if re.match(r'\s*/\*[0-9a-f]+\*/', x))
            if best is None or n > best[0]: best = (n, labels[m.group(1)], i)
    n, a, b = best
    ops = {}
    for x in lines[a:b+1]:
        m = re.match(r'\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)', x)
        if m: ops[m.group(2)] = ops.get(m.group(2), 0) + 1
    waits = [re.sub(r'.*(DEPBAR[^;]*);.*', r'\1', x) for x in lines[a:b+1] if "WARPGROUP.DEPBAR" in x]
    hg = [re.sub(r'.*(HGMMA\.\S+).*', r'\1', x) for x in lines[a:b+1] if "HGMMA" in x]
    print(f.split('/')[-1], "loop", n, dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10]), "waits", waits, hg[:2])
