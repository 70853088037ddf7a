"""One whole supervised fine-tuning run on the emulator, as a user makes it: a base model folder
(transformers' own `save_pretrained` of a tiny Llama, a byte-level tokenizer with a ChatML template) in
the emulator's S3 -> `trainstack data prepare --format chat --local` of docs/sft.md's conversations ->
`npx cdk deploy` -> `trainstack launch` -> the job really trains on CPU ranks from the base (sft: packed
rows, masked loss), the emulator delivers its end, the supervisor completes the run and, with
`export.on_complete`, starts the export job -> the exported folder, copied out of S3, loads in
transformers and answers a chat prompt: `apply_chat_template` + `generate` reply with a number and stop
at <|im_end|> (the end-of-turn token its generation_config lists), not at max_new_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from deployed_cloud import Cloud, wait_until

from trainstack.emulator import events as emulator_events
from trainstack.emulator.endpoint import ACCOUNT, REGION, Emulator

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sft-run")]
RECIPE = "tests/integration/fixtures/sft-run.yaml"
RECIPE_NAME = "sft-run"
DATA_STACK = f"Trainstack-platform-{RECIPE_NAME}-Data"
BUCKET = "trainstack-sft-run-data"  # the recipe's init_from and data.train_s3_uri
STEPS = 160
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# docs/sft.md's template: Qwen2's ChatML, the assistant's reply and its <|im_end|> marked as targets.
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m.content }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VALIDATION = re.compile(r"validation at step (\d+): val_loss ([\d.]+)")


def _base_folder(folder: Path) -> Path:
    """A tiny random Llama and its tokenizer files, as `save_pretrained` writes a base model."""
    import tokenizers as k
    import torch
    import transformers

    byte = k.pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab = {c: i for i, c in enumerate(sorted(byte.alphabet()))} | {
        s: 256 + i for i, s in enumerate(SPECIALS)
    }
    tok = k.Tokenizer(k.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = byte, k.decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    config |= {"pad_token": "<|endoftext|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    shape = dict(vocab_size=264, hidden_size=64, intermediate_size=176, num_hidden_layers=2)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**shape, bos_token_id=None, eos_token_id=256, pad_token_id=256)
    )
    model.save_pretrained(folder)
    return folder


def _conversations(path: Path) -> Path:
    """docs/sft.md's 144 arithmetic conversations and two lines that are not conversations."""
    chats = [
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": str(a + b)},
        ]
        for a in range(12)
        for b in range(12)
    ]
    lines = [json.dumps({"messages": c}) for c in chats]
    lines += ["{not json", json.dumps({"messages": [{"role": "user", "content": "hi"}]})]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    """The emulator as a user gets it (jobs train, events delivered by the emulator), the recipe
    deployed, the base in S3 and the conversations prepared there with `data prepare --local`."""
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("sft-run")
    with Emulator(log_path=work / "moto.log") as emulator:
        cloud = Cloud(emulator, work / "cdk-out")
        settings = emulator_events.configure(cloud.env)
        assert (settings["jobs"], settings["events"]) == ("train", "auto")
        cloud.cdk("bootstrap", f"aws://{ACCOUNT}/{REGION}")
        cloud.deploy(RECIPE)
        s3 = emulator.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        base = _base_folder(work / "base")
        for path in base.iterdir():
            s3.upload_file(str(path), BUCKET, f"base/{path.name}")
        prepared = cloud.cli(
            *("data", "prepare", str(_conversations(work / "chats.jsonl")), "--format", "chat"),
            *("--tokenizer", str(base), "--out", f"s3://{BUCKET}/chat/", "--seq-len", "256"),
            *("--validation-fraction", "0.1", "--local"),
        )
        assert prepared.returncode == 0, prepared.stdout + prepared.stderr
        assert "129 conversations" in prepared.stdout and "packed 43 sequences" in prepared.stdout
        cloud.work, cloud.s3 = work, s3  # type: ignore[attr-defined]
        yield cloud


def test_a_whole_sft_run_prepares_trains_completes_and_exports_a_chat_model_that_answers(
    cloud: Cloud,
) -> None:
    job, _ = cloud.launch(RECIPE, None, "--name", "chat")
    run = job.rsplit("-", 1)[0]
    record = cloud.wait_for_run(DATA_STACK, run, ("completed", "failed", "stopped"), timeout_s=900)
    assert record.state == "completed", record.why
    assert int(cloud.final_metrics(job)["train:step"]) == STEPS == record.step

    # It fine-tuned: from the base's weights (validation before step 1 is the base's loss on the
    # held-out conversations), a masked loss that fell.
    log = cloud.log_of(job)
    losses = {int(step): float(loss) for step, loss in VALIDATION.findall(log)}
    assert sorted(losses) == [0, 40, 80, 120, 160], log[-3000:]
    assert losses[STEPS] < 0.5 * losses[0], losses

    # The supervisor's on-complete export: the run's first export job, its folder in the bucket.
    export_job = f"{run}-X1"
    wait_until(
        lambda: cloud.sagemaker.list_training_jobs(NameContains=export_job)["TrainingJobSummaries"],
        lambda found: bool(found),
        300,
    )
    waiter = cloud.sagemaker.get_waiter("training_job_completed_or_stopped")
    waiter.wait(TrainingJobName=export_job, WaiterConfig={"Delay": 5, "MaxAttempts": 120})
    described = cloud.sagemaker.describe_training_job(TrainingJobName=export_job)
    assert described["TrainingJobStatus"] == "Completed", described.get("FailureReason")
    bucket = cloud.outputs(DATA_STACK)["BucketName"]
    s3 = cloud.s3  # type: ignore[attr-defined]
    prefix = f"exports/platform/{RECIPE_NAME}/chat/step-{STEPS}/"
    folder = cloud.work / "chat-model"  # type: ignore[attr-defined]
    folder.mkdir()
    for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]:
        s3.download_file(bucket, item["Key"], str(folder / item["Key"].removeprefix(prefix)))

    # A Hub chat model's files: the template (as the base had it) and the end of turn among the eos ids.
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [im_end, 256]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    for a, b in ((3, 4), (7, 5), (11, 2)):
        messages = [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": f"What is {a} plus {b}?"},
        ]
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        reply = model.generate(**prompt, max_new_tokens=12, do_sample=False)[
            0, prompt["input_ids"].shape[1] :
        ]
        text = tokenizer.decode(reply)
        # a number, then the end of its turn: generation stopped there, not at max_new_tokens
        assert re.fullmatch(r"\d{1,2}<\|im_end\|>", text), (a, b, text)

    # A user's own export of an earlier checkpoint, waited for as a pipeline step waits: `--wait` follows
    # the job the Export state machine creates until it ends, `--json` says how it ended, exit 0 when it
    # completed, and the folder of that step is in the bucket.
    earlier = STEPS - 40  # checkpoints every 40 steps, the last 2 kept
    waited = ("--wait", "--timeout", "280")  # within cloud.cli's 300 s
    exported = cloud.cli("export", run, "--step", str(earlier), *waited, "--local", "--json")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    ended = json.loads(exported.stdout)
    assert ended == {
        "run": run, "job": f"{run}-X2", "execution": ended["execution"], "status": "Completed",
        "failure_reason": None,
    }  # fmt: skip
    assert f"export job {run}-X2: Completed" in exported.stderr  # the progress lines, on stderr
    earlier_prefix = f"exports/platform/{RECIPE_NAME}/chat/step-{earlier}/"
    written = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=earlier_prefix)["Contents"]}
    assert {f"{earlier_prefix}config.json", f"{earlier_prefix}generation_config.json"} <= written
