"""The book builds strict (no warnings) and offline: no page loads a script, stylesheet or font
from outside the book; chapter 1 has its figures, its formulas' MathJax and a live calculator."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # notebooks, processes, a browser or a book build

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(built_book):
    return built_book


def test_build_is_strict(built):
    _, log = built
    assert "build succeeded" in log
    assert not re.search(r"WARNING: (?!.*Kernel is running over TCP)", log), log[-3000:]


EXTERNAL = re.compile(r"""<(script|link|img|iframe)\b[^>]*\b(src|href)\s*=\s*["'](https?:)?//""", re.I)


def test_no_external_assets(built):
    html, _ = built
    pages = list(html.rglob("*.html"))
    assert len(pages) >= 4
    offenders = {str(p.relative_to(html)): m.group(0) for p in pages for m in EXTERNAL.finditer(p.read_text())}
    assert not offenders, offenders
    for css in html.rglob("*.css"):  # fonts and imports from a CDN would hide here
        assert not re.search(r"url\(\s*['\"]?(https?:)?//|@import\s+url\(\s*['\"]?https?:", css.read_text(errors="ignore")), css


def test_chapter1_figures_math_and_calculator(built):
    html, _ = built
    page = (html / "book" / "01_where_memory_goes.html").read_text()
    imgs = re.findall(r'<img[^>]+src="([^"]*_images/[^"]+\.png)"', page)  # figures (not the theme's logos)
    assert len(imgs) >= 4
    for src in imgs:
        assert (html / "book" / src).resolve().stat().st_size > 10_000  # real figures, not empty files
    assert "vendor/mathjax/tex-chtml.js" in page and (html / "_static/vendor/mathjax/tex-chtml.js").exists()
    assert (html / "_static/vendor/mathjax/output/chtml/fonts/woff-v2").is_dir()
    # the live calculator: vramlab's HTML (no frozen widget view), its script, Pyodide and the package
    assert 'class="vramlab-calc" id="vl-training"' in page and "application/vnd.jupyter.widget-view+json" not in page
    assert 'src="../_static/live.mjs' in page and (html / "_static/vendor/pyodide/pyodide.asm.wasm").exists()
    manifest = (html / "_static/vramlab-live.json").read_text()
    assert re.search(r'"archive": "vendor/vramlab-[\d.]+-[0-9a-f]{12}\.zip"', manifest)
    # numbers computed by vramlab at build time, e.g. the seeds' BERT checkpoint
    assert "419.62 MiB" in page and "2.168 GiB" in page
    assert "CPU traces" in page  # the measured figures say what they are
    # the H100 section: provenance on the page, the allocator's three numbers, fit against the OOM boundary
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04" in page and "max_memory_reserved" in page
    assert "expandable_segments" in page and "memory_summary" in page
    for measured in ("104", "112", "120"):
        assert f">{measured}<" in page or f"{measured} " in page
    assert "transformers/activations.py:66" in page  # the live blocks at the peak, by frame
    assert "12.2 GB" in page and "device in use" in page  # the source article, reconciled


def test_lab_page_opens_in_colab(built):
    html, _ = built
    for chapter in ("intro", "01_where_memory_goes", "02_collectives", "05_mixed_precision"):  # .md: Colab can't open them
        assert "colab.research.google.com" not in (html / "book" / f"{chapter}.html").read_text(), chapter
    page = (html / "labs/release/lab01_where_memory_goes/lab01_where_memory_goes.html").read_text()
    links = re.findall(r'https://colab\.research\.google\.com/github/[^"]+', page)
    assert links and links[0].endswith("/blob/main/labs/release/lab01_where_memory_goes/lab01_where_memory_goes.ipynb")
    assert "NotImplementedError" in page and "BEGIN SOLUTION" not in page  # the student version, not executed


def test_chapter2_figures_and_measurements(built):
    html, _ = built
    page = (html / "book" / "02_collectives.html").read_text()
    assert len(re.findall(r'<img[^>]+src="[^"]*_images/[^"]+\.png"', page)) >= 4
    assert 'id="vl-collectives"' in page
    assert "fitted alpha" in page and "gloo" in page


def test_chapter5_formats_and_gradients(built):
    html, _ = built
    page = (html / "book" / "05_mixed_precision.html").read_text()
    assert len(re.findall(r'<img[^>]+src="[^"]*_images/[^"]+\.png"', page)) >= 2  # histogram, update survival
    assert "65504" in page.replace(",", "") or "6.55e+04" in page  # fp16's max, from the format table
    assert "loss_type" not in page  # no library warnings leak into the page
    assert "flush probe" in page and "tokens a step" in page  # the flush probe's table


def test_chapter3_schedules_split_and_calculator(built):
    """Chapter 3: the tensor-parallel split and three pipeline schedules drawn at build (inline SVG,
    the bubble's idle pattern in each Gantt chart), the Korthikanti table, and the live calculator."""
    html, _ = built
    page = (html / "book" / "03_parallelism.html").read_text()
    assert page.count('class="vl-figure"') >= 4
    assert page.count('fill="url(#vl-idle)"') >= 3 * 4  # an idle band behind each device of each chart
    assert "Tensor-parallel MLP on 2 devices" in page
    assert "GPipe: all forwards, then all backwards: bubble 27.3%" in page  # (p-1)/(m+p-1) = 3/11
    assert "interleaved 1F1B, 2 model chunks per GPU: bubble 15.8%" in page  # 3/19
    assert 'id="vl-parallel"' in page and "+ sequence parallel + selective" in page
    # predicted against measured, from lab 3's stored run: labelled as a CPU run, every rank listed
    measured = page.split('id="predicted-against-measured"')[1]
    assert "not a GPU measurement" in measured and "Not yet" not in measured
    lab = measured.split('id="validated-beyond-the-lab"')[0]
    assert lab.count("gpipe m=") == 8 + 4 and lab.count("1f1b m=") == 6 + 4 and lab.count("ddp x2") == 2
    assert lab.count("interleaved m=8 p=4") == 4 and lab.count("tp_sp x2") == 2 and lab.count("tp_full x2") == 2
    beyond = measured.split('id="validated-beyond-the-lab"')[1]
    assert "ranks and schedules in 21 runs" in beyond and "not a GPU measurement" in beyond
    assert "Traceback" not in page and "Error" not in page.split('id="vl-parallel"')[0][-20000:]


def test_chapter4_zero_stages_and_measurement(built):
    """Chapter 4: the stages drawn at build, the paper's Figure 1, DeepSpeed's two ZeRO-2 formulas with
    the docs' t5-3b number, and the measured run labelled as a CPU run with every setup listed."""
    html, _ = built
    page = (html / "book" / "04_zero.html").read_text()
    assert len(re.findall(r'<img[^>]+src="[^"]*_images/[^"]+\.png"', page)) >= 1
    for gb in ("120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"):
        assert gb in page
    assert "the docs&#x27; formula</td>" in page and ">15.93 GB<" in page  # DeepSpeed's estimators, a table
    measured = page.split('id="what-deepspeed-and-fsdp2-really-keep"')[1]
    assert "not a GPU measurement" in measured
    for name in ("ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2"):
        assert name in measured
    assert "setups in 18 runs" in page and "where-zero-2-beats-zero-1" in page
    assert "Traceback" not in page and "loss_type" not in page and "Warning" not in page


def test_chapter7_checkpointing(built):
    """Chapter 7: the step's memory drawn at build, the plans' trade-off for Llama 3.2 1B, the H100's
    measured none/full with their provenance, and lab 7's stored run labelled as a CPU run."""
    html, _ = built
    page = (html / "book" / "07_checkpointing.html").read_text()
    assert len(re.findall(r'<img[^>]+src="[^"]*_images/[^"]+\.png"', page)) >= 2
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04" in page and "43.84 GiB" in page and "27.26 GiB" in page
    measured = page.split('id="predicted-against-measured"')[1]
    assert "not a GPU" in measured
    for plan in ("none", "full", "sac-matmuls", "sqrt", "every-2", "first-4", "segments-4"):
        assert f">{plan}<" in measured  # a cell of the measured tables
    assert 'id="vl-checkpointing"' in page or "vl-checkpointing" in page
    longest = page.split('id="the-longest-sequence-each-plan-allows"')[1]
    assert "longest_sequence" in longest and ">sqrt<" in longest and "computed, not measured" in longest
    assert "Traceback" not in page and "Warning" not in page



def test_chapter6_offload(built):
    """Chapter 6: the streaming timelines drawn at build, the H100's save_on_cpu and FSDP2 offload
    measurements with their provenance, both live calculators, and lab 6's stored run labelled as a
    CPU run."""
    html, _ = built
    page = (html / "book" / "06_offload.html").read_text()
    assert len(re.findall(r'<img[^>]+src="[^"]*_images/[^"]+\.png"', page)) >= 1
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04" in page
    for measured in ("26.02 GiB", "25.69 GiB", "10.66 GiB"):  # save_on_cpu llama and gpt2, FSDP2: the stored peaks
        assert measured in page, measured
    assert 'id="vl-offload"' in page and 'id="vl-streaming"' in page
    measured = page.split('id="predicted-against-measured"')[1]
    assert "not a GPU measurement" in measured and "[0, 1, 2, 3, 4, 5, 6, 7]" in measured
    assert "Traceback" not in page and "Warning" not in page


def test_chapter8_compression(built):
    """Chapter 8: the H100's mT5-base full and LoRA peaks with their provenance, the per-tensor and
    per-row errors computed at build, the live calculator, and lab 8's stored run labelled as a CPU run."""
    html, _ = built
    page = (html / "book" / "08_compression.html").read_text()
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04" in page and "884,736" in page
    for measured in ("10.95 GiB", "3.72 GiB"):  # the stored mT5-base peaks: full fine-tune, LoRA r=8 q,v
        assert measured in page, measured
    assert 'id="vl-compression"' in page and "nf4-dq" in page
    measured = page.split('id="predicted-against-measured-lab-8"')[1]
    assert "not a GPU measurement" in measured and "distillation" in measured
    assert "Traceback" not in page and "Warning" not in page


def test_sections_are_built_with_their_numbers(built):
    """The added techniques are on their pages, computed at build and labelled: gradient
    accumulation, in-place operations and the caching allocator (ch 1), accumulation under ZeRO and
    FSDP2 (ch 4), pinned loaders and ZeRO-Infinity's NVMe tier (ch 6), what the compiler recomputes
    (ch 7), prompt/prefix/P-tuning and MoEfication (ch 8); and the calculators' new controls."""
    html, _ = built

    def section(chapter: str, anchor: str) -> str:
        page = (html / "book" / f"{chapter}.html").read_text()
        assert f'id="{anchor}"' in page, (chapter, anchor)
        assert "Traceback" not in page
        return page.split(f'id="{anchor}"')[1]

    ch1 = section("01_where_memory_goes", "gradient-accumulation")
    assert "micro-batch" in ch1
    inplace = section("01_where_memory_goes", "in-place-operations")
    assert "saved: measured" in inplace and "refused" in inplace and "modified by an inplace operation" in inplace
    alloc = section("01_where_memory_goes", "the-caching-allocator")
    assert "expandable_segments" in alloc and "empty_cache" in alloc
    calc = (html / "book" / "01_where_memory_goes.html").read_text()
    assert "every allowed site" in calc and "expandable segments" in calc  # the training calculator's controls
    ch4 = section("04_zero", "gradient-accumulation-under-zero-and-fsdp2")
    assert "no_sync" in ch4 and "set_requires_gradient_sync" in ch4
    pinned = section("06_offload", "pinned-memory-and-the-data-loader")
    assert "pin_memory" in pinned
    nvme = section("06_offload", "out-of-core-zero-infinity-s-nvme-tier")
    assert "offload_param" in nvme and "nvme" in nvme and "not a GPU measurement" in nvme
    ch7 = section("07_checkpointing", "what-the-compiler-recomputes-on-its-own")
    assert "inductor" in ch7 and "TorchScript" in ch7 and "fourth exercise" in ch7
    prompt = section("08_compression", "prompt-prefix-and-p-tuning")
    assert "P-tuning" in prompt and "virtual tokens" in prompt and "prompt_params" in prompt
    moe = section("08_compression", "turning-a-dense-model-into-experts")
    assert "MoEfication" in moe


def test_chapter3_context_parallelism(built):
    """Chapter 3's context-parallel section: the per-rank table computed at build, the gloo runs labelled
    as CPU measurements with their provenance, and the live calculator."""
    html, _ = built
    page = (html / "book" / "03_parallelism.html").read_text()
    cp = page.split('id="context-parallelism-split-the-sequence"')[1]
    assert "Ring attention" in cp and "Ulysses" in cp and "zig-zag" in cp
    assert "computed, not measured" in cp and "not a GPU measurement" in cp and "exact" in cp
    assert 'id="vl-context"' in page
    assert "Traceback" not in page


def test_mixture_of_experts_and_long_context(built):
    """Chapter 1's mixture-of-experts presets and calculator; chapter 3's expert parallelism (computed states
    and traffic, the gloo runs labelled as CPU measurements, its calculator) and what 32k-128k tokens take."""
    html, _ = built
    ch1 = (html / "book" / "01_where_memory_goes.html").read_text()
    moe = ch1.split('id="mixture-of-experts-every-expert-resident-a-few-of-them-used"')[1]
    for name in ("mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b", "olmoe-1b-7b"):
        assert name in moe, name
    assert "MLA" in moe and 'id="vl-moe"' in moe and "capacity" in moe
    ch3 = (html / "book" / "03_parallelism.html").read_text()
    ep = ch3.split('id="expert-parallelism-split-the-experts"')[1]
    assert "all-to-all" in ep and "computed, not measured" in ep and "not a GPU measurement" in ep
    assert "exact" in ep and 'id="vl-experts"' in ep
    long = ch3.split('id="k-to-128-k-tokens-what-it-takes"')[1].split('id="expert-parallelism')[0]
    assert "fused loss + full recompute" in long and "none fits" in long and "--recompute" in long
    assert "FSDP2 over the CP ranks" in long and "--fsdp" in long
    folded = ch3.split('id="experts-beside-tensor-and-pipeline-parallelism"')[1].split('id="beyond-one-machine"')[0]
    assert "2,048" in folded and "Megatron-Core" in folded and "tests/test_moe_layout.py" in folded
    assert "Traceback" not in ch1 and "Traceback" not in ch3


def test_serving(built):
    """Chapter 1's serving section: vLLM's start-up line computed, the KV dtypes side by side, transformers'
    paged cache measured on the CPU (labelled so) against the calculator, and the live calculator; chapter 8's
    quantized KV cache, byte for byte."""
    html, _ = built
    ch1 = (html / "book" / "01_where_memory_goes.html").read_text()
    serve = ch1.split('id="serving-a-paged-kv-cache-and-the-requests-it-holds"')[1].split('id="the-calculator"')[0]
    assert "Maximum concurrency for 2,000 tokens per request" in serve and "KV fp8" in serve
    assert "not a GPU measurement" in serve and "exact" in serve and "differs" not in serve
    assert 'id="vl-serving"' in serve and "vramlab serve" in serve
    ch8 = (html / "book" / "08_compression.html").read_text()
    kvq = ch8.split('id="the-kv-cache-quantized"')[1]
    assert "int8 + fp32 scales" in kvq and "33,792 B" in kvq and "predicted" not in kvq.split("</table>")[0]
    assert "Traceback" not in ch1 and "Traceback" not in ch8


def test_tool_comparison(built):
    """Chapter 1's comparison: accelerate, DeepSpeed's estimators, the Playbook's widget and the rule of thumb beside
    vramlab on the stored H100 runs, computed at build from the stored file, with what each leaves out."""
    html, _ = built
    ch1 = (html / "book" / "01_where_memory_goes.html").read_text()
    sec = ch1.split('id="how-the-tools-people-use-compare"')[1].split('id="does-it-fit-the-margin-between-allocated-and-out-of-memory"')[0]
    for tool in ("accelerate estimate-memory", "DeepSpeed, ZeRO-2 estimator", "Ultra-Scale Playbook widget",
                 "weights × 4 + 20 %", "median |error|", "max_memory_allocated"):
        assert tool in sec, tool
    assert "<img" in sec and "Traceback" not in sec



def test_snapshot_calculator_section(built):
    """Chapter 1's snapshot subsection: how to record one, and the explain calculator pre-rendered on the built-in
    example (labelled as built to PyTorch's format), with a file input the page reads (no upload)."""
    from vramlab.present import calculators as C

    html, _ = built
    ch1 = (html / "book" / "01_where_memory_goes.html").read_text()
    sec = ch1.split('id="your-own-out-of-memory-error-from-a-memory-snapshot"')[1].split('id="the-source-article')[0]
    assert "_record_memory_history" in sec and "_dump_snapshot" in sec and "Traceback" not in sec
    assert 'data-calc="explain"' in sec and 'type="file"' in sec and "nothing is uploaded" in sec.replace("\n", " ")
    assert "built to PyTorch" in sec and "not expected by the estimate" in sec
    allocated = C.get("explain").run(**C.EXAMPLE).numbers["allocated"]
    assert f'data-key="allocated" data-value="{allocated[0]!r}"' in sec and allocated[1] in sec


def test_optimizer_section(built):
    """Chapter 8's optimizer section: every optimizer's bytes for one model computed at build (where they live,
    the peak with the step after and inside the backward), the live calculator pre-rendered, the stored CPU
    measurements of the real libraries' storage beside the estimate."""
    from vramlab import optimizers as O
    from vramlab.present import calculators as C

    html, _ = built
    ch8 = (html / "book" / "08_compression.html").read_text()
    sec = ch8.split('id="the-optimizer-s-share')[1].split('id="try-it"')[0]
    for name in O.NAMES:
        assert O.INFO[name].label in sec.replace("&amp;", "&"), name
    assert "stepped in the backward" in sec and "Traceback" not in sec and 'data-calc="optimizers"' in sec
    peak = C.get("optimizers").run(model="llama-3.2-1b", optimizer="adafactor").numbers["peak"]
    assert f'data-key="peak" data-value="{peak[0]!r}"' in sec


def test_fp8_section(built):
    """Chapter 5's FP8 section: the recipes' bytes per parameter computed from `FP8_RECIPES` beside the Playbook's
    totals (which they reproduce), Llama 3.1 8B's model states and scales, the delayed-against-current scaling
    figure, the tile-scaling and format tables, and the statement that nothing ran on a GPU."""
    import html as _html

    from vramlab import precision as P

    out, _ = built
    ch5 = (out / "book" / "05_mixed_precision.html").read_text()
    sec = ch5.split('id="fp8-training-what-is-stored-in-eight-bits"')[1].split('id="the-calculator"')[0]
    for r in P.FP8_RECIPES.values():
        assert _html.escape(r.label) in sec, r.label
    assert "reproduces the Playbook" in sec and ">Playbook</th>" in sec
    assert "llama-3.1-8b" in sec and "149.58 GiB" in sec  # 20 B/param of the baseline, computed at build
    assert "one scale per tensor" in sec and "one per 1×128 tile" in sec and "e5m2" in sec
    assert "No fp8 matrix multiply ran" in sec and "no GPU was" in sec.replace("\n", " ")
    imgs = re.findall(r'<img[^>]+src="([^"]*_images/[^"]+\.png)"', sec)
    assert len(imgs) == 1 and (out / "book" / imgs[0]).resolve().stat().st_size > 10_000
    assert "Traceback" not in sec and "Error" not in sec
