# GPU pools: one per (region, model served there), their sizes and the vLLM command.

variables {
  config = yamldecode(file("tests/fixtures/three_regions.yaml"))
  model_settings = {
    "tiny-llama" = { source = "TinyLlama/TinyLlama-1.1B-Chat-v1.0", vllm_args = ["--max-model-len", "2048"] }
    "tiny-coder" = { source = "Qwen/Qwen2.5-Coder-1.5B-Instruct", max_num_seqs = 64 }
  }
}

run "one_pool_per_region_and_model" {
  command = plan

  assert {
    condition = toset(keys(output.gpu_pools)) == toset([
      "us-east/tiny-llama", "us-east/tiny-coder", "eu-west/tiny-llama", "ap-south/tiny-llama", "ap-south/tiny-coder",
    ])
    error_message = "pools are exactly the models each region serves"
  }
  assert {
    condition     = output.models == tolist(["tiny-coder", "tiny-llama"])
    error_message = "models lists every served model once"
  }
  assert {
    condition     = alltrue([for key, pool in output.gpu_pools : key == "${pool.region}/${pool.model}" && pool.cloud_region == output.regions[pool.region].cloud_region])
    error_message = "a pool runs in its region's cloud region"
  }
  assert {
    condition = alltrue([for pool in values(output.gpu_pools) : (
      pool.replicas == 1 && pool.machine_type == "g2-standard-8" && pool.gpu_type == "nvidia-l4"
    && pool.gpu_count == 1 && pool.spot == false && pool.disk_gb == 200 && pool.boot_s == 1800)])
    error_message = "defaults: one g2-standard-8 with one L4 per pool"
  }
}

run "vllm_command_line" {
  command = plan

  assert {
    condition = jsonencode(output.gpu_pools["eu-west/tiny-llama"].vllm_argv) == jsonencode([
      "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--served-model-name", "tiny-llama",
      "--host", "0.0.0.0", "--port", "8000", "--max-num-seqs", "256", "--max-model-len", "2048",
    ])
    error_message = "vllm serve SOURCE with the served name, address, batch size, then the model's own args"
  }
  assert {
    condition     = output.gpu_pools["ap-south/tiny-coder"].max_num_seqs == 64 && contains(output.gpu_pools["ap-south/tiny-coder"].vllm_argv, "64")
    error_message = "max_num_seqs reaches both vLLM and the worker agent"
  }
}

run "settings_precedence_pool_then_model_then_defaults" {
  command = plan

  variables {
    defaults = { gpu_replicas = 2, gpu_machine_type = "g2-standard-12" }
    model_settings = {
      "tiny-llama" = { source = "TinyLlama/TinyLlama-1.1B-Chat-v1.0", machine_type = "g2-standard-24", gpu_count = 2, replicas = 3 }
      "tiny-coder" = { source = "Qwen/Qwen2.5-Coder-1.5B-Instruct", gpu_count = 2, vllm_args = ["--tensor-parallel-size=1", "--pipeline-parallel-size=2"] }
    }
    region_settings = {
      "ap-south" = { gpu_pools = { "tiny-llama" = { replicas = 0, spot = true, machine_type = "a2-highgpu-1g", gpu_type = "nvidia-tesla-a100", gpu_count = 1 } } }
    }
  }

  assert {
    condition = (output.gpu_pools["us-east/tiny-llama"].replicas == 3
    && output.gpu_pools["us-east/tiny-llama"].machine_type == "g2-standard-24")
    error_message = "model settings override the defaults"
  }
  assert {
    condition = (output.gpu_pools["ap-south/tiny-llama"].replicas == 0 && output.gpu_pools["ap-south/tiny-llama"].spot
      && output.gpu_pools["ap-south/tiny-llama"].gpu_type == "nvidia-tesla-a100"
    && output.gpu_pools["ap-south/tiny-llama"].machine_type == "a2-highgpu-1g")
    error_message = "a region's pool settings override the model's (replicas 0 keeps an empty pool)"
  }
  assert {
    condition     = output.gpu_pools["us-east/tiny-coder"].replicas == 2 && output.gpu_pools["us-east/tiny-coder"].machine_type == "g2-standard-12"
    error_message = "defaults fill what neither pool nor model says"
  }
  assert {
    condition     = join(" ", slice(output.gpu_pools["us-east/tiny-llama"].vllm_argv, 9, 11)) == "--tensor-parallel-size 2"
    error_message = "several GPUs: tensor parallelism over all of them"
  }
  assert {
    condition     = length([for arg in output.gpu_pools["us-east/tiny-coder"].vllm_argv : arg if startswith(arg, "--tensor-parallel-size")]) == 1
    error_message = "a model's own --tensor-parallel-size is not overridden"
  }
  assert {
    condition     = !contains(output.gpu_pools["ap-south/tiny-llama"].vllm_argv, "--tensor-parallel-size")
    error_message = "one GPU: no tensor parallelism"
  }
}

run "names_are_valid_short_unique_and_stable" {
  command = plan

  variables {
    config = yamldecode(file("tests/fixtures/cloud_names.yaml"))
    model_settings = {
      "meta-llama/Llama-3.1-8B-Instruct"              = { source = "meta-llama/Llama-3.1-8B-Instruct" }
      "Qwen/Qwen2.5-Coder-32B-Instruct-AWQ"           = { source = "Qwen/Qwen2.5-Coder-32B-Instruct-AWQ" }
      "mistralai/Mistral-Small-3.1-24B-Instruct-2503" = { source = "mistralai/Mistral-Small-3.1-24B-Instruct-2503" }
    }
    region_settings = {
      "asia-southeast1-with-a-very-long-logical-name" = { cloud_region = "asia-southeast1" }
    }
  }

  assert {
    condition     = output.regions["us-central1"].cloud_region == "us-central1" && output.regions["europe-west4"].cloud_region == "europe-west4"
    error_message = "a region named like a Compute Engine region is that region"
  }
  assert {
    condition = alltrue(flatten([
      [for pool in values(output.gpu_pools) : can(regex("^[a-z]([-a-z0-9]{0,38}[a-z0-9])$", pool.name))],
      [for r in values(output.regions) : [for name in [r.router.name, r.redis.name, r.subnet_name] : can(regex("^[a-z]([-a-z0-9]{0,38}[a-z0-9])$", name))]],
    ]))
    error_message = "names: lowercase, digits and '-', start with a letter, at most 40 characters"
  }
  assert {
    condition     = output.gpu_pools["us-central1/meta-llama/Llama-3.1-8B-Instruct"].name == "gp-us-central1-meta-llama-llama-3-1-8b-instruct" || length(output.gpu_pools["us-central1/meta-llama/Llama-3.1-8B-Instruct"].name) == 40
    error_message = "a long name is cut to 40 characters, ending in a hash"
  }
  assert {
    condition = length(distinct(concat(
      [for pool in values(output.gpu_pools) : pool.name],
      flatten([for r in values(output.regions) : [r.router.name, r.redis.name, r.subnet_name]]),
    ))) == length(output.gpu_pools) + 3 * length(output.regions)
    error_message = "every resource name is unique"
  }
  assert {
    condition     = output.gpu_pools["us-central1/meta-llama/Llama-3.1-8B-Instruct"].vllm_argv[2] == "meta-llama/Llama-3.1-8B-Instruct"
    error_message = "the served model name is kept as written"
  }
}
