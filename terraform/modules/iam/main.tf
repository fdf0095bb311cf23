# One service account per kind of machine, each with only what it needs: writing logs
# and metrics here, reading its own secrets in the secrets module.

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
  description = "Prefix of the service account ids."
  type        = string
}

locals {
  kinds = {
    worker = "globalpool GPU workers (vLLM + worker agent)"
    router = "globalpool router replicas"
    redis  = "globalpool Redis nodes"
  }
  roles = ["roles/logging.logWriter", "roles/monitoring.metricWriter"]
  grants = {
    for pair in setproduct(keys(local.kinds), local.roles) : "${pair[0]} ${pair[1]}" => { kind = pair[0], role = pair[1] }
  }
}

resource "google_service_account" "machine" {
  for_each     = local.kinds
  project      = var.project_id
  account_id   = "${var.name_prefix}-${each.key}"
  display_name = each.value
}

resource "google_project_iam_member" "machine" {
  for_each = local.grants
  project  = var.project_id
  role     = each.value.role
  member   = "serviceAccount:${google_service_account.machine[each.value.kind].email}"
}

output "emails" {
  description = "Service account emails by kind: worker, router, redis."
  value       = { for kind, account in google_service_account.machine : kind => account.email }
}
