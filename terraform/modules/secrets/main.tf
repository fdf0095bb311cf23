# Secret Manager secrets, created EMPTY: an operator adds each value with
#   gcloud secrets versions add <id> --data-file=-
# so that no secret value ever passes through Terraform variables or state. Machines
# read the latest version at boot with their own service account.

terraform {
  required_version = ">= 1.9"
  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.0, < 8.0"
    }
  }
}

variable "project_id" {
  description = "The Google Cloud project."
  type        = string
}

variable "name_prefix" {
  description = "Prefix of the secret ids."
  type        = string
}

variable "readers" {
  description = "Service account emails by kind (worker, router, redis)."
  type        = map(string)
}

variable "labels" {
  description = "Labels on every secret."
  type        = map(string)
  default     = {}
}

locals {
  # name => who reads it. Optional secrets may stay without a version.
  secrets = {
    "redis-password"    = { readers = ["worker", "router", "redis"], optional = false, what = "Redis AUTH password, of the servers and of the sentinels (URL-safe, e.g. openssl rand -hex 32)" }
    "redis-tls-ca-cert" = { readers = ["worker", "router", "redis"], optional = false, what = "PEM certificate of the CA that signs the Redis nodes' TLS certificates; clients check the nodes against it" }
    "redis-tls-ca-key"  = { readers = ["redis"], optional = false, what = "PEM private key of that CA: each Redis node signs its own certificate with it at boot" }
    "heartbeat-keys"    = { readers = ["worker", "router"], optional = false, what = "heartbeat signing keys, key_id:secret per line (GLOBALPOOL_HEARTBEAT_KEYS_FILE)" }
    "admin-token"       = { readers = ["router"], optional = false, what = "the routers' admin API token" }
    "api-keys"          = { readers = ["router"], optional = true, what = "the keys file (auth.keys_file) with API key hashes" }
    "upstream-api-key"  = { readers = ["worker", "router"], optional = true, what = "the key routers send to vLLM (VLLM_API_KEY)" }
    "hf-token"          = { readers = ["worker"], optional = true, what = "Hugging Face token for gated models" }
  }
  grants = merge([
    for name, secret in local.secrets : {
      for reader in secret.readers : "${name} ${reader}" => { name = name, reader = reader }
    }
  ]...)
}

resource "google_secret_manager_secret" "this" {
  for_each  = local.secrets
  project   = var.project_id
  secret_id = "${var.name_prefix}-${each.key}"
  labels    = merge(var.labels, { optional = tostring(each.value.optional) })
  annotations = {
    content = each.value.what
  }

  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_iam_member" "reader" {
  for_each  = local.grants
  project   = var.project_id
  secret_id = google_secret_manager_secret.this[each.value.name].secret_id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${var.readers[each.value.reader]}"
}

output "ids" {
  description = "Secret resource names (projects/P/secrets/S) by short name."
  value       = { for name, secret in google_secret_manager_secret.this : name => secret.id }
}

output "add_version_commands" {
  description = "How to give each secret its value (run once per secret, and again to rotate)."
  value = {
    for name, secret in google_secret_manager_secret.this : name =>
    "gcloud secrets versions add ${secret.secret_id} --project ${var.project_id} --data-file=-  # ${local.secrets[name].what}${local.secrets[name].optional ? " (optional)" : ""}"
  }
}
