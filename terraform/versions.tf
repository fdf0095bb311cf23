terraform {
  required_version = ">= 1.9"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.0, < 8.0"
    }
  }

  # State in a GCS bucket you create once (versioned):
  #   terraform init -backend-config="bucket=<bucket>" -backend-config="prefix=globalpool"
  # It holds no secret values: secrets live only in Secret Manager.
  backend "gcs" {}
}

provider "google" {
  project = var.project_id
}
