# regions.yaml grows: keys this module does not read must not break it, and sections
# that are left out take the router's own defaults.

variables {
  model_settings = { "tiny-llama" = { source = "TinyLlama/TinyLlama-1.1B-Chat-v1.0" } }
}

run "a_minimal_file_takes_the_defaults" {
  command = plan

  variables {
    config = yamldecode(file("tests/fixtures/one_region.yaml"))
  }

  assert {
    condition     = keys(output.regions) == ["eu-west"] && keys(output.gpu_pools) == ["eu-west/tiny-llama"]
    error_message = "one region, one pool"
  }
  assert {
    condition     = output.redis_primary_region == "eu-west" && output.regions["eu-west"].redis.role == "primary"
    error_message = "without router.region the first region holds the Redis primary"
  }
  assert {
    condition     = output.redis.nodes == 1 && output.redis.quorum == 1
    error_message = "one Redis node: its own sentinel is the quorum (there is nothing to fail over to)"
  }
  assert {
    condition = (output.router.port == 8080 && output.router.lb_timeout_s == 930
      && output.router.admin_token_env == "GLOBALPOOL_ADMIN_TOKEN" && output.router.keys_file == null
    && length(output.router.upstream_key_envs) == 0)
    error_message = "router defaults match router/config.py"
  }
  assert {
    condition     = output.worker.key_prefix == "globalpool" && output.worker.heartbeat_interval_s == 0.5 && output.worker.heartbeat_ttl_s == 2
    error_message = "heartbeat and Redis defaults match router/config.py"
  }
}

run "unknown_and_newer_keys_are_ignored" {
  command = plan

  variables {
    config = yamldecode(file("tests/fixtures/future_keys.yaml"))
  }

  assert {
    condition     = toset(keys(output.gpu_pools)) == toset(["eu-west/tiny-llama", "us-east/tiny-llama"])
    error_message = "pools still follow regions.*.models"
  }
  assert {
    condition     = output.redis_primary_region == "eu-west"
    error_message = "router.region is read"
  }
  assert {
    condition     = output.router.port == 9000 && output.router.lb_timeout_s == 1231
    error_message = "router.port and router.timeouts.total_s are read (rounded up, plus a margin)"
  }
  assert {
    condition     = output.worker.key_prefix == "gp:prod" && output.worker.heartbeat_interval_s == 0.25 && output.worker.heartbeat_ttl_s == 1.5
    error_message = "redis.key_prefix and heartbeat.* are read"
  }
  assert {
    condition = (output.router.admin_token_env == "GP_ADMIN_TOKEN" && output.router.keys_file == "keys/prod.yaml"
    && output.router.upstream_key_envs == tolist(["GP_UPSTREAM_KEY"]))
    error_message = "admin.token_env, auth.keys_file and regions.*.upstream_api_key_env are read"
  }
}

run "port_zero_means_a_fixed_port_behind_the_load_balancer" {
  command = plan

  variables {
    config = {
      apiVersion = "globalpool/v1"
      router     = { port = 0 }
      regions    = { "us-east" = { models = ["tiny-llama"] } }
    }
  }

  assert {
    condition     = output.router.port == 8080
    error_message = "port 0 (any free port, for laptops) becomes 8080"
  }
}
