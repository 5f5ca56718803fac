"""A FluxPipeline directory with a real-size transformer and random weights, for end-to-end GPU checks.

    python tools/gpu_pipeline.py --size flux-12b --out /tmp/flux12b --device cuda   # 11.9B, bf16 (~24 GB on disk)
    python tools/gpu_pipeline.py --size tiny --out /tmp/flux-tiny                   # the same layout, seconds, CPU
    python main.py --pretrained /tmp/flux12b --resolution 512 --lora ...            # then train on it

No weights can be downloaded here, so the transformer is FLUX.1-dev's architecture (tools/gpu_check.py's
sizes) with random weights; the text encoders are small (1 layer) but project to the real embedding sizes
(T5 4096 per token, CLIP pooled 768), and the VAE is small with FLUX's 16 latent channels and 8x
downsampling, so latents, tokens and every transformer call have their real shapes at any resolution.
Step times are the transformer's; text encoding and decoding are cheaper than the real ones.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(size: str, out: str, device: str = "cpu") -> str:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from models.tiny_text import clip_tokenizer, t5_tokenizer
    from tools.gpu_check import gpu_sizes

    config = gpu_sizes()[size]["config"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    tokenizer, tokenizer_2 = clip_tokenizer(77), t5_tokenizer(512)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=config["pooled_projection_dim"], intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
        projection_dim=config["pooled_projection_dim"], bos_token_id=0, eos_token_id=1, pad_token_id=1))
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=config["joint_attention_dim"], d_kv=16, d_ff=64, num_layers=1,
        num_heads=2, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    start = time.perf_counter()
    torch.set_default_dtype(dtype)
    with torch.device(device):  # initialised on the device in the run dtype: minutes on a CPU for 12B
        transformer = FluxTransformer2DModel(**config)
    torch.set_default_dtype(torch.float32)
    init_s = time.perf_counter() - start
    vae = AutoencoderKL(  # 16 latent channels, 3 downsamplings (8x), like FLUX's VAE; small widths
        in_channels=3, out_channels=3, latent_channels=config["in_channels"] // 4, block_out_channels=(16, 16, 32, 32),
        layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=8, sample_size=512, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    start = time.perf_counter()
    pipe.save_pretrained(out)
    print(f"[gpu_pipeline] {size}: {sum(p.numel() for p in transformer.parameters()) / 1e9:.2f}B transformer "
          f"parameters, init {init_s:.0f} s, saved to {out} in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def main(argv=None) -> int:
    from tools.gpu_check import gpu_sizes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="flux-12b", choices=sorted(gpu_sizes()))
    parser.add_argument("--out", required=True, help="the pipeline directory to write")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to initialise the weights")
    args = parser.parse_args(argv)
    build(args.size, args.out, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
