"""GPU offload settings through the daemon, with SmolLM2: where llama.cpp put
each model's layers, what `tandem status` and `tandem show` say about the
devices, and clear start-up errors for a device or an RPC server that cannot
be used. Where the installed llama.cpp has no GPU backend (these CI machines),
the flags are accepted and status names how to install one; where it has one,
the layers asked for are on it."""

from __future__ import annotations

import llama_cpp

from tandem.daemon.models.devices import LoadLog, list_devices, rpc_server_binary

RPC_BUILD = bool(llama_cpp.llama_supports_rpc())
# the GPUs llama.cpp has in a process like the workers' (none on a build without a GPU backend)
GPUS = [d.name for d in list_devices() if d.kind in ("gpu", "igpu")]


def test_gpu_flags_place_the_layers_and_status_says_where(start_daemon, smollm2_path, tandem_cli):
    d = start_daemon(
        "--ctx-size", "512", "--gpu-layers", "all", "--drafter", str(smollm2_path), "--drafter-gpu-layers", "4"
    )
    with d.client() as c:
        st = c.status()
        reply = c.complete(prompt="The capital of France is", max_tokens=8, temperature=0.0)
    target, drafter = st.model, st.drafter_model
    assert reply.usage.completion_tokens > 0
    # llama.cpp places the 30 repeating layers and the output layer
    assert target.n_layers == 31 and sum(target.layers.values()) == 31
    assert drafter.n_layers == 31 and sum(drafter.layers.values()) == 31
    assert "CPU" in [dev.name for dev in target.devices if dev.kind == "cpu"]  # (a GPU backend's devices come first)
    assert target.gpu_layers_asked == -1 and drafter.gpu_layers_asked == 4
    assert sum(target.weights.values()) > 50 * 2**20  # the 92 MiB of weights, in llama.cpp's buffers
    out = tandem_cli(d.socket, "status").stdout
    gpus = [dev.name for dev in target.devices if dev.kind in ("gpu", "igpu")]
    assert gpus == GPUS
    if not gpus:  # this llama.cpp has no GPU backend: everything on the CPU, and status says how to get one
        assert target.layers == {"CPU": 31} and drafter.layers == {"CPU": 31}
        assert "no GPU backend is compiled into this llama-cpp-python" in out
        assert 'CMAKE_ARGS="-DGGML_CUDA=on"' in out and "-DGGML_METAL=on" in out
        assert "layers:    target all 31 on CPU; drafter all 31 on CPU" in out
        assert "every layer runs on the CPU" in d.log()  # the daemon's log says why too
    else:  # where one is lent: the layers asked for are on it
        assert target.layers.get("CPU", 0) == 0 and sum(target.layers[g] for g in gpus if g in target.layers) == 31
        assert sum(n for dev, n in drafter.layers.items() if dev != "CPU") == 4
        assert target.gpu_note == "" and "no GPU backend" not in out
    assert "devices:   " in out and "CPU (" in out


def test_the_prefix_cache_restores_kv_exactly_wherever_the_layers_are(start_daemon, page_restore):
    """KV pages are copied out of the device that holds the KV (llama.cpp's
    sequence state API) and back: on a GPU that is its memory, here the CPU's."""
    d = start_daemon("--ctx-size", "1024", "--gpu-layers", "all")
    system = "You are a terse assistant for a small software team. Answer in one or two sentences. " * 4
    long = [{"role": "system", "content": system}, {"role": "user", "content": "What is a mutex?"}]
    with d.client() as c:
        fresh, restored, from_pages = page_restore(c, long, [{"role": "user", "content": "Hi"}])
        where = c.status().model.layers
    assert restored == fresh and from_pages >= 64, (where, from_pages)


def test_device_none_keeps_every_layer_on_the_cpu(start_daemon):
    d = start_daemon("--ctx-size", "512", "--gpu-layers", "all", "--device", "none")
    with d.client() as c:
        assert c.status().model.layers == {"CPU": 31}


def test_an_unknown_device_stops_the_start_with_the_devices_there_are(daemon_process, smollm2_path):
    d = daemon_process(smollm2_path, "--ctx-size", "512", "--device", "NOPE0")
    try:
        assert d.proc.wait(60) == 1
        log = d.log()
        assert "no device named 'NOPE0' (devices here: " in log and "CPU" in log.split("devices here: ")[1]
        if not GPUS:
            assert 'CMAKE_ARGS="-DGGML_CUDA=on"' in log
        assert not d.socket.exists()
    finally:
        d.stop()
        d.cleanup()


def test_rpc_without_a_server_or_without_the_backend_says_what_to_do(daemon_process, smollm2_path, free_port):
    port = free_port()  # nothing listens there
    d = daemon_process(smollm2_path, "--ctx-size", "512", "--rpc", f"127.0.0.1:{port}")
    try:
        assert d.proc.wait(60) == 1
        log = d.log()
        if RPC_BUILD:
            assert f"cannot reach the rpc-server at 127.0.0.1:{port}" in log and f"-p {port}" in log
        else:
            assert "built without llama.cpp's RPC backend" in log and "-DGGML_RPC=on" in log
            assert "bench/build_rpc.sh" in log
    finally:
        d.stop()
        d.cleanup()


def test_a_remote_rpc_server_is_refused_before_anything_starts(daemon_process, smollm2_path):
    d = daemon_process(smollm2_path, "--rpc", "192.0.2.10:50052")  # TEST-NET-1: never this machine
    try:
        assert d.proc.wait(30) != 0
        log = d.log()
        assert "192.0.2.10:50052 is not this machine" in log and "--rpc-leaves-machine on" in log
        assert not d.socket.exists()
    finally:
        d.stop()
        d.cleanup()


def test_show_lists_the_devices_and_where_a_served_model_is(start_daemon, smollm2_path, tandem_cli):
    d = start_daemon("--ctx-size", "512")
    out = tandem_cli(d.socket, "show", str(smollm2_path)).stdout
    assert "devices          " in out and "CPU (" in out
    assert ("layers           all 31 on CPU (as the daemon at" in out) == (not GPUS)
    other = tandem_cli(d.socket.with_name("none.sock"), "show", str(smollm2_path)).stdout
    assert "CPU (" in other and "not loaded (the daemon does not serve it)" in other


def test_the_rpc_server_is_the_one_named_else_the_one_built(tmp_path, monkeypatch):
    fake = tmp_path / "rpc-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TANDEM_RPC_SERVER", str(fake))
    assert rpc_server_binary() == fake
    fake.chmod(0o644)
    assert rpc_server_binary() is None  # named but not executable: not another one instead
    monkeypatch.setenv("TANDEM_RPC_SERVER", str(tmp_path / "missing"))
    assert rpc_server_binary() is None
    monkeypatch.delenv("TANDEM_RPC_SERVER")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = tmp_path / "tandem" / "rpc-server" / llama_cpp.__version__ / "bin" / "rpc-server"
    assert rpc_server_binary() is None
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    built.chmod(0o755)
    assert rpc_server_binary() == built


def test_the_cpu_is_not_an_offload_device(daemon_process, smollm2_path):
    """llama.cpp offloads to GPUs and RPC servers; --device CPU would only move the
    weights out of the CPU's repacked buffers. --device none is the way to say it."""
    d = daemon_process(smollm2_path, "--ctx-size", "512", "--device", "CPU")
    try:
        assert d.proc.wait(60) == 1
        assert "CPU is not a device to offload to: every layer not offloaded runs there; use --device none" in d.log()
    finally:
        d.stop()
        d.cleanup()


def test_llama_cpps_error_lines_are_kept_whole_and_nothing_else():
    log = LoadLog()
    log.lines = [
        (1, "load_tensors: layer   0 assigned to device CPU, is_swa = 0\n"),
        (4, "llama_model_load: error loading model: "),
        (5, "tensor 'blk.0.attn_q.weight' has a wrong shape\n"),  # CONT: the same message
        (2, "a warning, not an error\n"),
        (5, "its continuation\n"),
        (4, "llama_model_load_from_file_impl: failed to load model\n"),
    ]
    assert log.placement().errors == [
        "llama_model_load: error loading model: tensor 'blk.0.attn_q.weight' has a wrong shape",
        "llama_model_load_from_file_impl: failed to load model",
    ]
    assert log.placement().layers == {"CPU": 1}
