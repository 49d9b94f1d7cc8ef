"""What counting an editor's cost costs: the demo's tiny Stable Diffusion UNet, run with and without
``lance_pipeline.editing.cost.count_network_cost`` (forward hooks and the FLOP-counting dispatch mode), interleaved in
one process so that the machine's load hits both alike. Reports the median ratio, and checks the outputs are equal.

    python benchmarks/bench_cost_counting.py [--steps 20] [--repeats 5] [--size 64]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch

    from builder.model_refs import materialize_demo_component
    from lance_pipeline.editing.cost import count_network_cost
    from lance_pipeline.editing.sd_components import load_stable_diffusion_components

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = str(materialize_demo_component("tiny-stable-diffusion"))
    unet = load_stable_diffusion_components(model, None, "float32", "cpu", None).unet
    latent_side = args.size // 8
    torch.manual_seed(0)
    latents = torch.randn(2, unet.config.in_channels, latent_side, latent_side)
    text = torch.randn(2, 77, unet.config.cross_attention_dim)

    def run():
        with torch.inference_mode():
            return [unet(latents, t, encoder_hidden_states=text).sample for t in range(args.steps)]

    plain, counted, flops = [], [], 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        reference = run()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        with count_network_cost({"unet": unet}) as cost:
            out = run()
        counted.append(time.perf_counter() - start)
        flops = cost.flops
        assert all(torch.equal(a, b) for a, b in zip(reference, out, strict=True)), "counting changed the output"
    print(
        f"{args.steps} UNet calls of batch 2 at {args.size} px: plain {statistics.median(plain):.3f} s, counted "
        f"{statistics.median(counted):.3f} s (median of {args.repeats}; ratio "
        f"{statistics.median(counted) / statistics.median(plain):.2f}); {cost.forwards['unet']} sample-forwards, "
        f"{flops / 1e9:.2f} GFLOP counted; outputs equal"
    )


if __name__ == "__main__":
    main()
