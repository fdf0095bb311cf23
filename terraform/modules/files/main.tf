# The bucket of the Files and Batch APIs: every router replica, in every region, keeps
# uploaded files and batch results here (regions.yaml batch.storage = gs://<bucket>/files,
# set by the topology module's router_regions_yaml), so that a batch uploaded through one
# region's routers is run by replicas anywhere. Only the routers' service account may
# read or write its objects; nothing in it is ever public.

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
  description = "The deployment's prefix; the bucket is <prefix>-files-<project>, since bucket names are global to all of Cloud Storage."
  type        = string
}

variable "location" {
  description = "Where the bucket lives: a multi-region (US, EU, ASIA), a dual-region or a region. Read when the bucket is created only (a bucket cannot move)."
  type        = string
}

variable "retention_days" {
  description = "Objects (uploaded files, batch inputs and results) are deleted this many days after they were written."
  type        = number

  validation {
    # A batch has 24 hours to run and reads its input file until it ends.
    condition     = var.retention_days >= 2 && floor(var.retention_days) == var.retention_days
    error_message = "retention_days (files_retention_days at the root): a whole number of days, at least 2 (a batch may read its input file for 24 hours after it starts)."
  }
}

variable "kms_key_name" {
  description = "A Cloud KMS key (projects/P/locations/L/keyRings/R/cryptoKeys/K) in the bucket's location to encrypt new objects with; null: Google-managed keys."
  type        = string
  default     = null
}

variable "router_service_account" {
  description = "The routers' service account email: the only principal given access to the objects."
  type        = string
}

variable "labels" {
  description = "Labels on the bucket."
  type        = map(string)
  default     = {}
}

locals {
  # Bucket names are global to all of Cloud Storage: the project id makes this one unique.
  # Domain-scoped project ids (example.com:project) have characters a bucket name cannot,
  # and may make it longer than its 63 characters.
  bucket_name = trim(substr("${var.name_prefix}-files-${replace(var.project_id, "/[^a-z0-9-]/", "-")}", 0, 63), "-")
}

# With a customer-managed key, Cloud Storage's own service agent encrypts and decrypts
# with it: it needs that role on the key before the bucket can name it.
data "google_storage_project_service_account" "agent" {
  count   = var.kms_key_name == null ? 0 : 1
  project = var.project_id
}

resource "google_kms_crypto_key_iam_member" "agent" {
  count         = var.kms_key_name == null ? 0 : 1
  crypto_key_id = var.kms_key_name
  role          = "roles/cloudkms.cryptoKeyEncrypterDecrypter"
  member        = "serviceAccount:${data.google_storage_project_service_account.agent[0].email_address}"
}

resource "google_storage_bucket" "files" {
  project       = var.project_id
  name          = local.bucket_name
  location      = upper(var.location)
  storage_class = "STANDARD"
  labels        = merge(var.labels, { globalpool-kind = "files" })

  # IAM alone decides who reads an object (no per-object ACLs), and no IAM binding can
  # make one public.
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  # `terraform destroy` fails rather than delete a bucket that still holds tenants' files.
  force_destroy = false

  # Off: the router writes each object once, under a fresh file id, and never
  # overwrites one, so there is no older version to keep; and a file a client deletes, or
  # the rule below expires, must go, not linger as a noncurrent version. Soft delete
  # (below) is the undo for a mistaken delete.
  versioning {
    enabled = false
  }

  # Uploaded files and batch results are deleted after retention_days, so that they do not
  # pile up forever. (Their records in Redis stay: reading such a file's content then
  # answers file_content_missing, and a batch whose input file is gone ends as failed.)
  lifecycle_rule {
    condition {
      age = var.retention_days
    }
    action {
      type = "Delete"
    }
  }

  # An upload that a router did not finish (its client went away, the router died) leaves
  # parts that are billed but belong to no object: drop them after a day.
  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  # Deleted objects stay restorable for 7 days (Cloud Storage's default, made explicit):
  # the undo for a mistaken delete, and how long a deleted tenant's file still exists.
  soft_delete_policy {
    retention_duration_seconds = 7 * 24 * 3600
  }

  dynamic "encryption" {
    for_each = var.kms_key_name == null ? [] : [var.kms_key_name]
    content {
      default_kms_key_name = encryption.value
    }
  }

  # A bucket cannot move: its location is chosen when it is created, and a later change
  # of files_location, or of the home region it defaults from (router.region,
  # redis_primary_region), must not plan to destroy it (which force_destroy = false
  # would refuse, halting every apply).
  lifecycle {
    ignore_changes = [location]
  }

  depends_on = [google_kms_crypto_key_iam_member.agent]
}

# Object read, write, list and delete (and the multipart uploads that streamed uploads
# are), on this bucket only: no project-wide storage role, no bucket administration.
resource "google_storage_bucket_iam_member" "router" {
  bucket = google_storage_bucket.files.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${var.router_service_account}"
}

output "name" {
  description = "The bucket's name."
  value       = google_storage_bucket.files.name
}

output "storage" {
  description = "regions.yaml batch.storage for the routers: gs://<bucket>/files. Known once the routers may use it (the bucket exists and they have access)."
  value       = "gs://${google_storage_bucket.files.name}/files"
  depends_on  = [google_storage_bucket_iam_member.router]
}
