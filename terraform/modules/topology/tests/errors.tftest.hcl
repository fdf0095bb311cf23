# Mistakes are refused at plan time, with a message that says what to set.

variables {
  config = yamldecode(file("tests/fixtures/three_regions.yaml"))
  model_settings = {
    "tiny-llama" = { source = "TinyLlama/TinyLlama-1.1B-Chat-v1.0" }
    "tiny-coder" = { source = "Qwen/Qwen2.5-Coder-1.5B-Instruct" }
  }
}

run "another_api_version" {
  command = plan
  variables {
    config = yamldecode(file("tests/fixtures/bad_version.yaml"))
  }
  expect_failures = [var.config]
}

run "no_regions" {
  command = plan
  variables {
    config = { apiVersion = "globalpool/v1", regions = {} }
  }
  expect_failures = [var.config]
}

run "a_model_without_settings" {
  command = plan
  variables {
    model_settings = { "tiny-llama" = { source = "TinyLlama/TinyLlama-1.1B-Chat-v1.0" } }
  }
  expect_failures = [output.gpu_pools]
}

run "a_region_without_a_cloud_region" {
  command = plan
  variables {
    config = yamldecode(file("tests/fixtures/unknown_region.yaml"))
  }
  expect_failures = [output.regions]
}

run "settings_for_a_region_that_does_not_exist" {
  command = plan
  variables {
    region_settings = { "us-eats" = { router_replicas = 3 } }
  }
  expect_failures = [var.region_settings]
}

run "a_primary_region_that_does_not_exist" {
  command = plan
  variables {
    redis_primary_region = "mars-base"
  }
  expect_failures = [var.redis_primary_region]
}

run "vllm_args_that_the_module_sets" {
  command = plan
  variables {
    model_settings = {
      "tiny-llama" = { source = "TinyLlama/TinyLlama-1.1B-Chat-v1.0", vllm_args = ["--port=9000"] }
      "tiny-coder" = { source = "Qwen/Qwen2.5-Coder-1.5B-Instruct" }
    }
  }
  expect_failures = [var.model_settings]
}

run "two_regions_on_one_cloud_region" {
  command = plan
  variables {
    region_settings = { "eu-west" = { cloud_region = "us-east4" } }
  }
  expect_failures = [output.regions]
}

run "no_router_replicas" {
  command = plan
  variables {
    region_settings = { "eu-west" = { router_replicas = 0 } }
  }
  expect_failures = [output.regions]
}

run "fewer_router_replicas_at_most_than_at_least" {
  command = plan
  variables {
    region_settings = { "eu-west" = { router_replicas = 3, router_max_replicas = 2 } }
  }
  expect_failures = [output.regions]
}

run "a_cpu_target_above_one" {
  command = plan
  variables {
    defaults = { router_cpu_target = 60 }
  }
  expect_failures = [var.defaults]
}

run "fractional_gpus" {
  command = plan
  variables {
    defaults = { gpu_count = 1.5 }
  }
  expect_failures = [output.gpu_pools]
}
